"""A download's progress in words, for the node's console: a line every LOG_SECONDS or
every LOG_FRACTION of the bytes, whichever comes first, so a long download shows it is
alive and a short one does not flood the log."""

import time

from loguru import logger

LOG_SECONDS = 5.0
LOG_FRACTION = 0.1


def eta_seconds(downloaded: int, total: int, bytes_per_second: float) -> float | None:
    """Seconds left at this speed; None while there is no speed to go by."""
    if downloaded >= total:
        return 0.0
    if bytes_per_second <= 0:
        return None
    return (total - downloaded) / bytes_per_second


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "time left unknown"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h{minutes:02d}m left"
    return f"{minutes}m{secs:02d}s left" if minutes else f"{secs}s left"


def progress_line(model_id: str, downloaded: int, total: int, bytes_per_second: float) -> str:
    """`downloading org/name: [#####-----] 48% 12.3/25.6 MB at 3.1 MB/s, 4s left`"""
    fraction = downloaded / total if total else 1.0
    bar = "#" * round(fraction * 20)
    return (
        f"downloading {model_id}: [{bar:-<20}] {fraction:4.0%} {downloaded / 1e6:.1f}/{total / 1e6:.1f} MB"
        f" at {bytes_per_second / 1e6:.1f} MB/s, {_duration(eta_seconds(downloaded, total, bytes_per_second))}"
    )


class ConsoleProgress:
    """Logs a model's progress line when LOG_SECONDS passed or LOG_FRACTION more arrived."""

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        self._logged_at = time.monotonic()
        self._logged_fraction = 0.0

    def update(self, downloaded: int, total: int, bytes_per_second: float) -> None:
        fraction = downloaded / total if total else 1.0
        now = time.monotonic()
        if downloaded >= total or (
            now - self._logged_at < LOG_SECONDS and fraction - self._logged_fraction < LOG_FRACTION
        ):
            return  # the end has its own line ("downloaded ... to ...")
        self._logged_at, self._logged_fraction = now, fraction
        logger.info(progress_line(self.model_id, downloaded, total, bytes_per_second))
