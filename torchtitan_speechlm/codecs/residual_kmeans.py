"""Residual k-means that gives the same codebooks on any x86 CPU.

A fit in float32 follows the BLAS and FFT code path of the machine it runs on: MKL picks AVX2 or
AVX-512 kernels, torch vectorises its reductions by the CPU it finds, and their different
rounding moves a distance across a tie, a point into another cluster, a k-means++ draw to
another point, and from there every centroid (24% of the demo corpus' codes changed between
``MKL_ENABLE_INSTRUCTIONS=AVX2`` and the default). Here no decision depends on the order of a
sum: the vectors (normalised features, each stage's residuals) and the centroids are integers,
multiples of ``GRID`` held as float64 grid units, small enough (``LIMIT``) that every product
and partial sum of a squared distance is an integer below 2^53. float64 arithmetic on them is
exact, so BLAS computes the same distances in any order, on any kernel; the centroids are exact
sums divided by their counts and rounded to the grid; k-means++ draws an integer from a seeded
PCG64 stream in the exact cumulative sum of the squared distances. The only numbers left to
the machine are the features themselves (computed in float64), whose rounding moves a value
across a grid boundary about once in 10^12 values.

``encode`` is what a codec's ``encode`` uses too, so the codes of the same audio are the same on
any machine as well.
"""

from __future__ import annotations

import math

import numpy as np

GRID = 2.0**-12  # normalised values are multiples of this (about 4,000 steps per sd)
LIMIT = float(2**19)  # |grid units| of a vector at most (128 sd); residuals within 2 x LIMIT,
MAX_DIM = 2048  # so a squared distance's terms and partial sums stay below 2^53


def to_grid(x: np.ndarray) -> np.ndarray:
    """float64 values -> float64 grid units (``x / GRID`` rounded half to even, clipped)."""
    return np.clip(np.rint(np.asarray(x, dtype=np.float64) / GRID), -LIMIT, LIMIT)


STATS_GRID = 2.0**-20  # the normalisation's means and deviations are multiples of this


def column_stats(x: np.ndarray, floor: float = 1e-3) -> tuple[np.ndarray, np.ndarray]:
    """Per-column mean and (floored) standard deviation of float64 rows ``x``: exact sums,
    rounded to ``STATS_GRID`` (the features' last bits, which differ between machines, then
    leave them alone, and with them the codec's weights and identity)."""
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[0]
    mean = np.array([math.fsum(col) / n for col in x.T])
    var = [math.fsum((col - m) ** 2) / max(n - 1, 1) for col, m in zip(x.T, mean, strict=True)]
    std = np.maximum(np.sqrt(np.array(var)), floor)
    return np.rint(mean / STATS_GRID) * STATS_GRID, np.rint(std / STATS_GRID) * STATS_GRID


def _check(points: np.ndarray) -> None:
    if points.shape[1] > MAX_DIM:
        raise ValueError(f"residual k-means: {points.shape[1]} dimensions, at most {MAX_DIM}")


def nearest(points: np.ndarray, centers: np.ndarray) -> np.ndarray:
    """Index of the nearest centroid for each point (grid units; exact, lowest index on a tie)."""
    d = np.einsum("ij,ij->i", centers, centers)[None, :] - 2.0 * (points @ centers.T)
    return np.argmin(d, axis=1)


def kmeans_pp(points: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding: ``k`` of the grid ``points`` as the initial centroids."""
    m = points.shape[0]
    pp = np.einsum("ij,ij->i", points, points)
    centers = [points[int(rng.integers(m))]]

    def dist2(c: np.ndarray) -> np.ndarray:
        return (pp + c @ c - 2.0 * (points @ c)).astype(np.int64)

    d2 = dist2(centers[0])
    if float(d2.max()) * m >= 2.0**62:
        raise ValueError("residual k-means: vectors too far apart to draw from exactly")
    for _ in range(1, k):
        total = int(d2.sum())
        if total == 0:  # every point is a centroid already
            pick = int(rng.integers(m))
        else:
            pick = int(np.searchsorted(np.cumsum(d2), int(rng.integers(total)), side="right"))
        centers.append(points[pick])
        d2 = np.minimum(d2, dist2(centers[-1]))
    return np.stack(centers)


def lloyd(
    points: np.ndarray, centers: np.ndarray, iters: int, rng: np.random.Generator
) -> np.ndarray:
    """``iters`` Lloyd iterations; a centroid that empties takes a point drawn from ``rng``."""
    k, d = centers.shape
    for _ in range(iters):
        a = nearest(points, centers)
        sums = np.zeros((k, d))
        np.add.at(sums, a, points)  # integer sums below 2^53: exact in any order
        counts = np.bincount(a, minlength=k)
        have = counts > 0
        new = centers.copy()
        new[have] = np.rint(sums[have] / counts[have, None])
        for j in np.flatnonzero(~have):
            new[j] = points[int(rng.integers(points.shape[0]))]
        if np.array_equal(new, centers):
            break
        centers = new
    return centers


def fit(vectors: np.ndarray, num_codebooks: int, size: int, seed: int, iters: int = 20,
        seed_points: int = 32) -> np.ndarray:  # fmt: skip
    """Residual codebooks ``[num_codebooks, size, d]`` in grid units (int32) of normalised
    float64 ``vectors`` [n, d]: codebook q quantises what 0..q-1 left, seeded by k-means++ on a
    seeded draw of ``seed_points x size`` points, refined by Lloyd on all of them."""
    rng = np.random.default_rng(seed)
    points = to_grid(vectors)
    _check(points)
    if points.shape[0] < size:
        raise ValueError(f"{points.shape[0]} vectors cannot fit {size} centroids")
    books = []
    for _ in range(num_codebooks):
        m = min(points.shape[0], seed_points * size)
        sub = points[np.sort(rng.permutation(points.shape[0])[:m])]
        centers = lloyd(points, kmeans_pp(sub, size, rng), iters, rng)
        books.append(centers)
        points = points - centers[nearest(points, centers)]
    return np.stack(books).astype(np.int32)


def encode(vectors: np.ndarray, books: np.ndarray) -> np.ndarray:
    """Codes ``[n, num_codebooks]`` (int64) of normalised float64 ``vectors`` under grid
    ``books`` (``fit``'s)."""
    points = to_grid(vectors)
    _check(points)
    codes = []
    for book in np.asarray(books, dtype=np.float64):
        a = nearest(points, book)
        codes.append(a)
        points = points - book[a]
    return np.stack(codes, 1).astype(np.int64) if codes else np.zeros((len(points), 0), np.int64)


def dequantise(codes: np.ndarray, books: np.ndarray) -> np.ndarray:
    """Normalised float64 vectors ``[n, d]`` that ``codes`` stand for."""
    codes = np.asarray(codes)
    out = np.zeros((codes.shape[0], books.shape[2]))
    for q in range(codes.shape[1]):
        out += np.asarray(books[q], dtype=np.float64)[codes[:, q]]
    return out * GRID


def draw_rows(n: int, limit: int, seed: int) -> np.ndarray | None:
    """Sorted indices of a seeded draw of ``limit`` of ``n`` rows, or None when all ``n`` fit:
    a fit's vectors are capped the same way by every codec that fits."""
    if n <= limit:
        return None
    return np.sort(np.random.default_rng(seed).permutation(n)[:limit])


def fit_standardised(
    x: np.ndarray, num_codebooks: int, size: int, seed: int, iters: int = 20
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``fit`` on ``x`` standardised per column (``column_stats``): the codebooks and the mean
    and std to standardise with again at encoding."""
    mean, std = column_stats(x)
    return fit((x - mean) / std, num_codebooks, size, seed, iters), mean, std
