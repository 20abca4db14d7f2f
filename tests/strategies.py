"""Hypothesis strategies shared by the test modules: random packed layouts with options, and random mask
geometries of one sequence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

BOUNDED = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclass(frozen=True)
class Layout:
    lens_q: list[int]
    lens_k: list[int]
    hq: int
    hkv: int
    d: int
    dv: int
    mask: dict[str, Any]
    seed: int


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    batch = draw(st.integers(1, 6))
    lens = st.lists(st.integers(0, 40), min_size=batch, max_size=batch)
    hq, hkv = draw(st.sampled_from([(1, 1), (2, 1), (4, 2)]))
    causal = draw(st.booleans())
    bound = st.one_of(st.just(-1), st.integers(0, 12))  # unbounded half the time, so sdpa runs often
    left = draw(bound)
    right = draw(st.integers(-1, 0) if causal else bound)
    mask: dict[str, Any] = {"causal": causal, "window_size": (left, right)}
    mask["softcap"] = draw(st.one_of(st.just(0.0), st.floats(0.5, 50.0)))
    if draw(st.booleans()):
        mask["softmax_scale"] = draw(st.floats(0.05, 2.0))
    return Layout(
        draw(lens),
        draw(lens),
        hq,
        hkv,
        draw(st.sampled_from([8, 16])),
        draw(st.sampled_from([8, 12])),
        mask,
        draw(st.integers(0, 2**31 - 1)),
    )


@st.composite
def geometries(draw: st.DrawFn) -> tuple[int, int, int, int]:
    lq, lk = draw(st.integers(0, 70)), draw(st.integers(0, 40))
    bound = st.one_of(st.just(-1), st.integers(0, 80))
    return lq, lk, draw(bound), draw(bound)
