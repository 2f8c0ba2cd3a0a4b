"""The engine's clocks: the host's float64 ms and the device's float32 ms.

The host clock is float64 ms since the engine's construction (``now_ms``).
The device holds float32 ms since a device epoch (``device_ms``), which
moves forward (``rebase``) once the host clock is ``DEVICE_REBASE_MS`` past
it, to the oldest live arrival (or to now), every live device time shifted
with it; so device times stay below ~2**21 ms and keep sub-ms resolution
however long the engine runs. An iteration's emissions are stamped on the
device with its launch time and corrected one iteration late, by the next
plan program, to the time the host published them (``stamp``).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

# Device times are float32 ms since the device epoch; once the host clock is
# this far past the epoch (float32 resolution 2**-3 ms here), the epoch
# moves to the oldest live arrival, or to now when nothing is live.
DEVICE_REBASE_MS = float(2**20)


class EngineClocks:
  """The injected clock (seconds), the device epoch and the pending
  emission correction of one engine."""

  def __init__(self, clock: Callable[[], float]):
    self.clock = clock
    self.t0 = clock()
    self.skipped_ms = 0.0           # idle time skipped without waiting (``skip``)
    self.device_epoch_ms = 0.0      # host ms at device time 0
    # The last iteration's (emitted bool[R], launch stamp, publication time)
    # in device ms, corrected on the device by the next plan program.
    self.stamp = None
    self._no_stamp_mask = None

  def now_ms(self) -> float:
    """Engine clock: ms since construction (float64 on the host), the
    skipped idle time included."""
    return (self.clock() - self.t0) * 1000.0 + self.skipped_ms

  def skip(self, ms: float) -> None:
    """Moves the engine clock ``ms`` (>= 0) forward without waiting: a
    replay not in real time skipping an idle gap on the wall clock, as a
    virtual clock's ``advance`` does (``replay(realtime=False)``); so the
    gap is in every later time, one axis for all. Only between requests
    (nothing live), or a live request's times would jump.

    Raises:
      ValueError: ``ms`` < 0; a virtual clock (it advances itself, and the
        device loop reads its time from it).
    """
    if ms < 0:
      raise ValueError(f"EngineClocks.skip needs ms >= 0, got {ms}")
    if hasattr(self.clock, "advance"):
      raise ValueError("EngineClocks.skip is for the wall clock; a virtual clock advances "
                       "(VirtualClock.advance)")
    self.skipped_ms += ms

  def device_ms(self, host_ms: float) -> np.float32:
    """A host time as the device's float32 ms since the device epoch."""
    return np.float32(host_ms - self.device_epoch_ms)

  def rebase(self, now_ms: float, live_arrivals_ms: Sequence[float]) -> Optional[float]:
    """Moves the device epoch forward once ``now_ms`` is ``DEVICE_REBASE_MS``
    past it, to the oldest of ``live_arrivals_ms`` (live or pending
    requests) or to now; the pending correction moves with it. Returns the
    shift (ms) every device time must move by, None when the epoch stays."""
    if now_ms - self.device_epoch_ms < DEVICE_REBASE_MS:
      return None
    epoch = min([now_ms] + list(live_arrivals_ms))
    shift = epoch - self.device_epoch_ms
    if shift <= 0:
      return None
    if self.stamp is not None:
      emitted, stamp, actual = self.stamp
      self.stamp = (emitted, np.float32(stamp) - np.float32(shift),
                    np.float32(actual) - np.float32(shift))
    self.device_epoch_ms = epoch
    return shift

  def pending_stamp(self, num_slots: int, placement):
    """(bool[R] emitted, f32[] launch stamp, f32[] publication time) of the
    last iteration, still to be corrected on the device; a no-op triple
    when none is pending (``placement`` puts its mask on the devices)."""
    if self.stamp is None or self.stamp[0].shape[0] != num_slots:
      return self.no_fix(num_slots, placement)
    return self.stamp

  def no_fix(self, num_slots: int, placement):
    """The no-op correction triple (``no_stamp``, 0, 0)."""
    return self.no_stamp(num_slots, placement), np.float32(0), np.float32(0)

  def no_stamp(self, num_slots: int, placement):
    """bool[R] all False on the devices: no emission to correct."""
    if self._no_stamp_mask is None or self._no_stamp_mask.shape[0] != num_slots:
      self._no_stamp_mask = placement.tables(np.zeros(num_slots, bool))
    return self._no_stamp_mask
