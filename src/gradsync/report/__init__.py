"""Terminal tables, metrics files and plots for training runs."""

from .training import print_summary, write_outputs

__all__ = ["print_summary", "write_outputs"]
