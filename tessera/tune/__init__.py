"""Schedule tuning: compile candidates in parallel, time each once on the device, cache the winner."""

from tessera.tune.tuner import TuningRecord, tune

__all__ = ["TuningRecord", "tune"]
