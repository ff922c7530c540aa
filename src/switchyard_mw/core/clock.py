"""The clock every time-dependent rule reads, injectable so tests never sleep."""

import time
from collections.abc import Callable

Clock = Callable[[], float]
"""Returns seconds on a monotonic scale."""

monotonic: Clock = time.monotonic
