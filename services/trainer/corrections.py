"""The off-policy corrections both the loss and the settings name (docs/corrections.md): what is
done with the importance weight w = pi_old / mu, and the checks on their bands. No torch here:
the trainer's settings import it before any heavy module loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

IS_MODES = ("truncate", "mask", "mask_truncate")


@dataclass(frozen=True)
class Correction:
    """What is done with the importance weight w = pi_old / mu (services/trainer/loss.py's docstring).

    `cap` is `tis_cap`: in `truncate` mode None turns importance sampling off (the ratio is then
    against mu); `mask` ignores it; `mask_truncate` needs it. `band` is [is_low, is_high];
    `reject` the sequence rejection band, None on a side that is not bounded."""

    mode: str = "truncate"
    cap: float | None = 2.0
    band: tuple[float, float] = (0.5, 5.0)
    reject: tuple[float | None, float | None] = (None, None)

    def __post_init__(self) -> None:
        if self.mode not in IS_MODES:
            raise ValueError(f"unknown is_mode {self.mode!r}; expected one of {IS_MODES}")
        low, high = self.band
        if not 0 < low < 1 < high:
            raise ValueError(f"the masking band [is_low, is_high] = [{low}, {high}] must satisfy 0 < is_low < 1 < "
                             "is_high: a weight of 1 (sampler and trainer agree) must always be kept")
        if self.mode == "mask_truncate" and self.cap is None:
            raise ValueError("is_mode mask_truncate truncates the kept weights at tis_cap: set tis_cap > 0")
        r_low, r_high = self.reject
        if r_low is not None and not 0 < r_low < 1:
            raise ValueError(f"seq_reject_low must be in (0, 1), got {r_low}")
        if r_high is not None and not r_high > 1:
            raise ValueError(f"seq_reject_high must be > 1, got {r_high}")

    @classmethod
    def of(cls, settings: Any) -> Correction:
        """The correction named by an object with the trainer's setting names (TrainerSettings,
        LossConfig): is_mode, tis_cap, is_low, is_high, seq_reject_low, seq_reject_high."""
        return cls(mode=settings.is_mode, cap=settings.tis_cap, band=(settings.is_low, settings.is_high),
                   reject=(settings.seq_reject_low, settings.seq_reject_high))

    @property
    def weight_cap(self) -> float | None:
        return None if self.mode == "mask" else self.cap

    @property
    def proximal(self) -> bool:
        """Whether pi_old anchors the ratio (decoupled PPO); without any importance weighting
        (`truncate` with no cap) mu does."""
        return self.mode != "truncate" or self.cap is not None

    @property
    def rejects(self) -> bool:
        return self.reject != (None, None)

    @property
    def depends_on_forward(self) -> bool:
        """Whether what carries loss depends on pi_old (masking, rejection): the normaliser is
        then known only after the forwards."""
        return self.mode != "truncate" or self.rejects
