"""The kinds of layer the model's list is made of, one module each (docs/code.md)."""
