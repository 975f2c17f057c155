"""Startup progress: one log line per phase of `accelerate_model` as it starts, and a tqdm bar on a terminal.

A first start on a fresh GPU machine compiles, tunes and captures for tens of seconds; users of vLLM-style engines
expect to see which phase is running and how long each took. Each phase logs "hf_accel: <phase>..." at INFO when it
starts and its duration when the next one starts; the bar (tqdm, shown only when stderr is a terminal) names the
current phase. `StartupProgress.times` keeps the split for `engine_info(model)["startup"]`.
"""

from __future__ import annotations

import logging
import sys
import time

logger = logging.getLogger("hf_accel")


class StartupProgress:
    """Phases of one startup, in order: `phase(name, detail)` ends the previous phase and starts the next."""

    def __init__(self, total_phases: int, enabled: bool = True) -> None:
        self.times: dict[str, float] = {}
        self._current: str | None = None
        self._t0 = time.perf_counter()
        self._bar = None
        if enabled and sys.stderr is not None and getattr(sys.stderr, "isatty", lambda: False)():
            try:
                from tqdm.auto import tqdm

                self._bar = tqdm(total=total_phases, desc="hf_accel startup", unit="phase", leave=False)
            except Exception:  # tqdm missing or broken: log lines only
                self._bar = None

    def phase(self, name: str, detail: str = "") -> None:
        self._finish_current()
        self._current = name
        self._t0 = time.perf_counter()
        logger.info("hf_accel: %s%s...", name, f" ({detail})" if detail else "")
        if self._bar is not None:
            self._bar.set_description(f"hf_accel: {name}")

    def _finish_current(self) -> None:
        if self._current is None:
            return
        seconds = time.perf_counter() - self._t0
        self.times[self._current] = self.times.get(self._current, 0.0) + seconds
        logger.info("hf_accel: %s done in %.1f s", self._current, seconds)
        if self._bar is not None:
            self._bar.update(1)
        self._current = None

    def close(self) -> None:
        self._finish_current()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
