"""The test models live in tessera.examples.models (the main job runs them too)."""

from tessera.examples.models import *  # noqa: F403
from tessera.examples.models import rotate_half  # noqa: F401
