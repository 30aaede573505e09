"""scikit-learn's bundled 8x8 handwritten digits (no download), as image tensors, and an
independent classifier that scores how recognisable generated digits are."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

PIXEL_MAX = 16.0  # the digits data set stores 4-bit intensities, 0..16


def to_model_range(pixels: np.ndarray | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(pixels, dtype=torch.float32) / PIXEL_MAX * 2.0 - 1.0


def to_pixel_range(images: torch.Tensor) -> np.ndarray:
    return ((images.detach().float().clamp(-1, 1) + 1.0) / 2.0 * PIXEL_MAX).cpu().numpy()


@lru_cache(maxsize=1)
def _raw() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.images.astype(np.float32), data.target.astype(np.int64)


def load_digits_images() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1797 digits: images (N, 1, 8, 8) scaled to [-1, 1], labels (N,)."""
    images, labels = _raw()
    return to_model_range(images)[:, None], torch.from_numpy(labels)


def parse_digits(text: str) -> list[int]:
    """'0123' -> [0, 1, 2, 3]; anything but the characters 0-9 is a ValueError."""
    if not text or not text.isdigit() or not text.isascii():
        raise ValueError(f"--digits must be a string of the characters 0-9 (e.g. 0123456789), got {text!r}")
    return [int(ch) for ch in text]


@dataclass
class DigitClassifier:
    """Logistic regression on the real digits' pixels; knows nothing of any generator."""

    model: object
    held_out_accuracy: float

    def predict(self, images: torch.Tensor) -> np.ndarray:
        return self.model.predict(to_pixel_range(images).reshape(len(images), -1))

    def accuracy(self, images: torch.Tensor, labels: torch.Tensor | list[int]) -> float:
        return float(np.mean(self.predict(images) == np.asarray(labels)))


@lru_cache(maxsize=1)
def digit_classifier(seed: int = 0) -> DigitClassifier:
    """Fit on 80% of the real digits; ``held_out_accuracy`` is on the other 20%."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    images, labels = _raw()
    x = images.reshape(len(images), -1)
    x_train, x_test, y_train, y_test = train_test_split(
        x, labels, test_size=0.2, random_state=seed, stratify=labels
    )
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    model.fit(x_train, y_train)
    return DigitClassifier(model=model, held_out_accuracy=float(model.score(x_test, y_test)))
