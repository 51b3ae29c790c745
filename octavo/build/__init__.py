"""Ahead-of-time builds of an exported model for a GPU runtime (`octavo build MODEL --target tensorrt`)."""
