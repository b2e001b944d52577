"""A trained checkpoint put to use: generation from a checkpoint, its flags, and export to Hugging Face."""
