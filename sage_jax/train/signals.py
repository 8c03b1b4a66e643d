"""Preemption and Ctrl-C: SIGTERM or SIGINT asks the training loop to save at the end of the step under way and
exit (0 after SIGTERM, a preemption; 130 after SIGINT, as a shell reports Ctrl-C); a second signal exits at once.

Python runs a signal handler only when the main thread returns to the interpreter, so a handler alone would not
act while the main thread waits inside a long XLA call (the step, or its compilation). Here the C-level handler's
wake-up byte (`signal.set_wakeup_fd`) is read by a watcher thread, which reports the signal the moment it
arrives, sets the flag the loop reads at the step's end, and ends the process on a second signal. The loop waits
for each step before it dispatches the next (it prepares the next batch meanwhile), so a save starts right after
the step under way ends: the worst-case delay is one step plus one checkpoint write.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
    """Install with `Preemption()` (from the main thread), read `.requested` at step boundaries, `restore()` at
    the end; `exit_code` is what the process should end with after the save."""

    def __init__(self):
        self.signum: int | None = None
        self._count = 0
        self._old = {sig: signal.signal(sig, self._handler) for sig in SIGNALS}
        self._read, write = os.pipe()
        os.set_blocking(write, False)
        self._old_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._write = write
        self._thread = threading.Thread(target=self._watch, name="sage_jax-signals", daemon=True)
        self._thread.start()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return 130 if self.signum == signal.SIGINT else 0

    def _handler(self, signum, frame):  # the watcher thread has acted on the wake-up byte already
        del signum, frame

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self._read, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in SIGNALS:
                    self._on(signum)

    def _on(self, signum: int) -> None:
        self._count += 1
        name = signal.Signals(signum).name
        if self._count == 1:
            self.signum = signum
            log.warning("%s received: saving a checkpoint when the step under way ends, then exiting (send it "
                        "again to exit at once, without saving)", name)
            return
        sys.stderr.write(f"\n{name} again: exiting now, without saving (the last checkpoint is kept)\n")
        sys.stderr.flush()
        os._exit(128 + signum)

    def restore(self) -> None:
        """The previous handlers and wake-up fd back; the watcher thread ends."""
        signal.set_wakeup_fd(self._old_fd)
        for sig, old in self._old.items():
            signal.signal(sig, old)
        os.close(self._write)
        self._thread.join(timeout=1.0)
        os.close(self._read)
