"""Device memory and speed: the computed memory plan, a device of a chosen size, and the hardware peaks."""
