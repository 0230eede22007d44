"""Framework backends: the only code in the project that imports torch or paddle."""
