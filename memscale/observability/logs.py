"""memscale's logging: the ``memscale`` logger tree and what ``wrap`` adds.

Every module logs to ``logging.getLogger(__name__)``, a child of
``memscale``, which carries a ``NullHandler``: a library stays quiet unless
asked.  ``wrap`` asks, per its Config:

* ``enable_logging=True`` (the default) and the application has not
  configured logging (the root logger has no handler, and nobody set a
  level or a handler on ``memscale``): a handler on ``memscale`` prints INFO
  and above to ``sys.stderr``: one line per plan (what was decided, the
  expected peak, where the details are), warnings, and little else.  The
  hardware, the strategy decision and the per-layer plan table are DEBUG
  records (``model._memscale_executor.describe()`` returns them too).
  While a tqdm progress bar is open (a Trainer's), a record is written
  with ``tqdm.write``: on a line of its own, the bar drawn again below it.
  When the application has configured logging, memscale adds nothing: its
  records reach the application's handlers at the application's levels.
* ``log_file=PATH``: DEBUG and above (the plan table included) are
  appended to PATH while the model is wrapped.
* ``enable_logging=False``: neither; the plan is not logged, and a
  ``log_file`` is not opened (a ``UserWarning`` says so).

For these records to reach the handlers, memscale sets the ``memscale``
logger's level to INFO (DEBUG while a log file is open) while one of its
handlers is installed, and only when that level was unset (``NOTSET``);
the last ``detach`` removes the handlers, closes the file and puts the
level back.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["ROOT_LOGGER", "application_configured_logging", "attach_logging"]

ROOT_LOGGER = "memscale"
STDERR_FORMAT = "%(levelname)s %(name)s: %(message)s"
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_lock = threading.RLock()
_stderr: dict[str, Any] = {"handler": None, "users": 0}
_files: dict[str, list[Any]] = {}  # absolute path -> [handler, users]
_level: dict[str, Any] = {"users": 0, "set_by_us": False}


class _StderrHandler(logging.StreamHandler):
    """Writes to the current ``sys.stderr`` (which may be replaced after the
    handler is made), and stands down if the application configures the
    root logger later, so that no record is printed twice."""

    _memscale_owned = True

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setLevel(logging.INFO)
        self.setFormatter(logging.Formatter(STDERR_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        self.setStream(sys.stderr)
        bars = _open_progress_bars()
        if bars is None:
            super().emit(record)
            return
        # A progress bar is drawn on its line (a Trainer's tqdm bar): the
        # bar is cleared, the record written on a line of its own, and the
        # bar drawn again below it, instead of the record being appended
        # to the bar's line.
        try:
            bars.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging's own convention
            self.handleError(record)


def _open_progress_bars() -> Any:
    """tqdm's bar class when tqdm is imported and a bar is open (tqdm's
    ``write`` then prints around every open bar), else None."""
    std = sys.modules.get("tqdm.std")
    bar = getattr(std, "tqdm", None)
    if bar is None or not getattr(bar, "_instances", None):
        return None
    return bar


class _FileHandler(logging.FileHandler):
    _memscale_owned = True


def application_configured_logging() -> bool:
    """Whether the application has set up logging that covers memscale."""
    if logging.getLogger().handlers:
        return True
    logger = logging.getLogger(ROOT_LOGGER)
    if not logger.propagate:
        return True
    if logger.level != logging.NOTSET and not _level["set_by_us"]:
        return True
    return any(
        not isinstance(h, logging.NullHandler) and not getattr(h, "_memscale_owned", False)
        for h in logger.handlers
    )


def _raise_level(level: int = logging.INFO) -> None:
    logger = logging.getLogger(ROOT_LOGGER)
    if _level["users"] == 0 and logger.level == logging.NOTSET:
        logger.setLevel(level)
        _level["set_by_us"] = True
    elif _level["set_by_us"] and level < logger.level:
        logger.setLevel(level)  # a log file takes DEBUG too
    _level["users"] += 1


def _release_level() -> None:
    _level["users"] -= 1
    if _level["users"] == 0 and _level["set_by_us"]:
        logger = logging.getLogger(ROOT_LOGGER)
        if logger.level in (logging.INFO, logging.DEBUG):
            logger.setLevel(logging.NOTSET)
        _level["set_by_us"] = False


def _add_stderr() -> Callable[[], None]:
    logger = logging.getLogger(ROOT_LOGGER)
    if _stderr["users"] == 0:
        _stderr["handler"] = _StderrHandler()
        logger.addHandler(_stderr["handler"])
    _stderr["users"] += 1
    _raise_level()

    def undo() -> None:
        with _lock:
            _release_level()
            _stderr["users"] -= 1
            if _stderr["users"] == 0:
                logger.removeHandler(_stderr["handler"])
                _stderr["handler"] = None

    return undo


def _add_file(path: str) -> Callable[[], None]:
    logger = logging.getLogger(ROOT_LOGGER)
    key = os.path.abspath(path)
    entry = _files.get(key)
    if entry is None:
        try:
            handler = _FileHandler(key, mode="a", encoding="utf-8")
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"memscale cannot open Config.log_file={path!r}: "
                f"{exc.strerror or exc}. Create its directory, choose another "
                "path, or set log_file=None",
            ) from exc
        handler.setLevel(logging.DEBUG)
        handler.setFormatter(logging.Formatter(FILE_FORMAT))
        logger.addHandler(handler)
        entry = _files[key] = [handler, 0]
    entry[1] += 1
    _raise_level(logging.DEBUG)

    def undo() -> None:
        with _lock:
            _release_level()
            entry[1] -= 1
            if entry[1] == 0:
                logger.removeHandler(entry[0])
                entry[0].close()
                _files.pop(key, None)

    return undo


def attach_logging(config: Any) -> Callable[[], None]:
    """Install what ``config`` asks for; return the action that removes it
    (``detach`` runs it).  Raises ``OSError`` naming ``Config.log_file``
    when the file cannot be opened (nothing is left installed then)."""
    undo: list[Callable[[], None]] = []

    def undo_all() -> None:
        while undo:
            undo.pop()()

    with _lock:
        if not config.enable_logging:
            if config.log_file is not None:
                warnings.warn(
                    f"Config.log_file={config.log_file!r} is set but "
                    "enable_logging=False, so nothing is written there; set "
                    "enable_logging=True to log the hardware and plan to it",
                    UserWarning,
                    stacklevel=3,
                )
            return undo_all
        try:
            if not application_configured_logging():
                undo.append(_add_stderr())
            if config.log_file is not None:
                undo.append(_add_file(config.log_file))
        except BaseException:
            undo_all()
            raise
    return undo_all
