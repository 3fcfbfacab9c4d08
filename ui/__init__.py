"""The Gradio front end of UNI MAX. It talks to unimax.service only."""

from .page import build_demo

__all__ = ["build_demo"]
