"""Online tuning of communication settings (tensor-fusion threshold) identical on every rank."""

from .fusion import FusionTuner, TrialRecord

__all__ = ["FusionTuner", "TrialRecord"]
