"""The notebook chat: a pure-Python view-model and its ipywidgets view."""
