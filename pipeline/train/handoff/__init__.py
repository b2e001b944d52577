"""What leaves training: text generation from a checkpoint (text_generation.py), its flags checked before anything
loads (generation_flags.py), and the export to a Hugging Face directory (hf_export.py)."""
