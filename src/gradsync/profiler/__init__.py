"""Measurements of compute and communication: compute-only step timing, dense all-reduce timing, CCR."""
