"""Weight grids, round-to-nearest, and error-compensating rounding (GPTQ).

A backend quantizes a weight matrix [out, in] on a grid it derives from the weights
themselves: per output row, or per group of ``group`` inputs of a row, a step and an
offset from the row's (group's) extremes. ``WeightGrid`` names two such derivations:

* asymmetric: 2^bits levels from the minimum to the maximum (a float offset). GGUF's
  Q4_1; TPU-MLIR's W4F16 groups once the export moves each group's minimum out
  (``group_offsets``: its integer zero point is then 0); QNN's signed 4-bit blocks once
  the export moves each group's centre out (``block_centres``).
* symmetric: levels -(2^(bits-1) - 1) .. 2^(bits-1) - 1 of max|w| / (2^(bits-1) - 1).
  QNN's per-channel int8 (onnxruntime's symmetric int8) and its int8 blocks; TPU-MLIR's
  W8F16 per channel.
* asymmetric with an integer zero point (``integer_zero``): 2^bits levels over
  [min(w, 0), max(w, 0)], zero on a level (the zero point round(-min / step)). RKNN's
  per-channel int8 (rknn-toolkit2 2.5.0, rk3588 w8a8: found by experiment, see
  docs/quantization.md); onnxruntime's asymmetric uint8.

GPTQ (Frantar et al., 2023) rounds the columns of W one after another and moves each
column's rounding error onto the columns not yet rounded, weighted by the inverse
Hessian H = X^T X of the layer's inputs, which minimises ||X W^T - X Q^T|| far better
than rounding each weight alone. Its output must survive the backend's own rounding:
the backend sees only the exported weights and derives its grid from their extremes.
So every row (group) keeps its extremes on the grid's end levels: the element that set
the minimum (maximum, largest magnitude) when the grid was drawn is rounded to that end
level whatever the error feedback did to it. The exported row then spans exactly the
grid GPTQ used, the backend derives the same step and offset, and its round-to-nearest
of each exported weight is GPTQ's choice.
"""

from dataclasses import dataclass

import torch

from npuforge.errors import NpuforgeError

# Hessian damping, as a fraction of its mean diagonal (GPTQ's default).
DAMP = 0.01
# Columns rounded between two updates of the rest (GPTQ's lazy batch), rounded down to a
# multiple of the group.
BLOCK = 128
# The fractions of a row's (group's) full range that ``search_range`` tries.
RANGE_FRACTIONS = tuple(1 - i / 100 for i in range(51))


@dataclass(frozen=True)
class WeightGrid:
    bits: int
    group: int | None = None  # inputs per step and offset; None: one per output row
    symmetric: bool = False
    integer_zero: bool = False  # asymmetric over a range holding 0, which is a level
    # Each row's (group's) range narrowed to the one that rounds it with the least
    # error (``_narrowed``), the weights beyond it clipped to the end levels.
    search_range: bool = False

    def __post_init__(self):
        if self.bits not in (2, 3, 4, 5, 6, 7, 8):
            raise NpuforgeError(f"weight grids have 2 to 8 bits, got {self.bits}")
        if self.group is not None and self.group < 2:
            raise NpuforgeError(f"a weight group holds 2 inputs or more, got {self.group}")
        if self.symmetric and self.integer_zero:
            raise NpuforgeError("a symmetric grid's zero point is 0; drop integer_zero")

    @property
    def levels(self) -> tuple[int, int]:
        """The lowest and highest integer level."""
        if self.symmetric:
            top = 2 ** (self.bits - 1) - 1
            return -top, top
        return 0, 2**self.bits - 1

    def describe(self) -> str:
        kind = "symmetric" if self.symmetric else "asymmetric"
        if self.integer_zero:
            kind += " with an integer zero point"
        where = f"groups of {self.group}" if self.group else "per output channel"
        searched = ", range searched" if self.search_range else ""
        return f"{self.bits}-bit {kind}, {where}{searched}"


def _check_shape(weight, grid):
    if weight.dim() != 2:
        raise NpuforgeError(f"weight grids quantize matrices, got shape {tuple(weight.shape)}")
    if grid.group is not None and weight.shape[1] % grid.group:
        raise NpuforgeError(
            f"a weight of {weight.shape[1]} inputs does not split into groups of {grid.group}; "
            "use a group that divides every matmul's input width"
        )


class _Span:
    """Step, offset and pinned extremes of the rows of one group of columns [rows, g]."""

    def __init__(self, block: torch.Tensor, grid: WeightGrid, pin: bool = True, importance=None):
        low, high = grid.levels
        self.low, self.high = low, high
        # Pins: (column, level, rows it applies to) per extreme. A searched range keeps
        # them: the elements that set the full range lie beyond the narrowed one, so they
        # round to its end levels, and the exported row again spans the grid exactly.
        if grid.symmetric:
            magnitude, where = block.abs().max(1)
            if grid.search_range:
                magnitude = _narrowed(block, grid, importance, magnitude=magnitude)[1]
            self.step, self.offset = _step_and_offset(-magnitude, magnitude, grid)
            sign = torch.sign(block.gather(1, where[:, None])[:, 0])
            # The largest magnitude keeps its end level (its sign's end).
            level = torch.where(sign < 0, low, high)
            self.pins = [(where, level, torch.ones_like(where, dtype=torch.bool))]
        else:
            minimum, at_min = block.min(1)
            maximum, at_max = block.max(1)
            if grid.search_range:
                minimum, maximum = _narrowed(block, grid, importance, minimum, maximum)
            every = torch.ones_like(at_min, dtype=torch.bool)
            low_pin, high_pin = every, every
            if grid.integer_zero:
                # The range holds 0; an extreme on the zero's side has no level to keep.
                low_pin, high_pin = minimum < 0, maximum > 0
                minimum, maximum = minimum.clamp(max=0), maximum.clamp(min=0)
            self.step, self.offset = _step_and_offset(minimum, maximum, grid)
            self.pins = [
                (at_min, torch.full_like(at_min, low), low_pin),
                (at_max, torch.full_like(at_max, high), high_pin),
            ]
        if not pin:
            self.pins = []
        # A constant row (group) stays constant: every weight on its offset's level.
        self.constant = self.step <= 0
        self.rest = 0 if grid.symmetric else low
        self.step = torch.where(self.constant, torch.ones_like(self.step), self.step)

    def round_all(self, block: torch.Tensor) -> torch.Tensor:
        """The grid values of the whole group ``block`` [rows, g], pins applied."""
        offset, step = self.offset[:, None], self.step[:, None]
        levels = torch.clamp(torch.round((block - offset) / step), self.low, self.high)
        for where, level, rows in self.pins:
            pinned = levels.gather(1, where[:, None])[:, 0]
            pinned = torch.where(rows, level.to(levels.dtype), pinned)
            levels.scatter_(1, where[:, None], pinned[:, None])
        levels = torch.where(self.constant[:, None], self.rest, levels)
        return offset + levels * step

    def round(self, column: torch.Tensor, index: int) -> torch.Tensor:
        """The grid value of ``column`` (the group's column ``index``), pins applied."""
        levels = torch.clamp(torch.round((column - self.offset) / self.step), self.low, self.high)
        for where, level, rows in self.pins:
            hit = (where == index) & rows
            levels = torch.where(hit, level.to(levels.dtype), levels)
        levels = torch.where(self.constant, self.rest, levels)
        return self.offset + levels * self.step


def _step_and_offset(minimum, maximum, grid):
    """The asymmetric grid's step over [minimum, maximum] (0 for a constant row) and its
    offset: the minimum, or with ``integer_zero`` (a range holding 0) the minimum moved
    onto the level of 0; symmetric (minimum = -maximum): maximum / top, offset 0."""
    low, high = grid.levels
    if grid.symmetric:
        return maximum / high, torch.zeros_like(maximum)
    step = (maximum - minimum) / (high - low)
    if not grid.integer_zero:
        return step, minimum
    safe = torch.where(step > 0, step, torch.ones_like(step))
    return step, -torch.round(-minimum / safe) * safe


def _narrowed(block, grid, importance, minimum=None, maximum=None, magnitude=None):
    """Per row of ``block`` [rows, g]: the range among ``RANGE_FRACTIONS`` of the full one
    whose rounding (weights beyond it clipped to the end levels) has the least squared
    error, each column weighted by ``importance`` [g] (the Hessian's diagonal: the energy
    of that input; None: equal). Returns (minimum, maximum) narrowed about the centre
    (symmetric: about 0; ``integer_zero``: towards 0, which stays on a level)."""
    low, high = grid.levels
    if grid.symmetric:
        minimum, maximum = -magnitude, magnitude
    elif grid.integer_zero:
        minimum, maximum = minimum.clamp(max=0), maximum.clamp(min=0)
    centre = torch.zeros_like(minimum) if grid.integer_zero else (minimum + maximum) / 2
    weights = None if importance is None else importance.to(block.dtype)
    best_error = best_low = best_high = None
    for fraction in RANGE_FRACTIONS:  # one pass per fraction: the rows stay in cache
        lows = centre + (minimum - centre) * fraction
        highs = centre + (maximum - centre) * fraction
        step, offset = _step_and_offset(lows, highs, grid)
        safe = torch.where(step > 0, step, torch.ones_like(step))
        levels = torch.clamp(torch.round((block - offset[:, None]) / safe[:, None]), low, high)
        error = (offset[:, None] + levels * safe[:, None] - block).square_()
        if weights is not None:
            error.mul_(weights)
        error = error.sum(1)
        if best_error is None:
            best_error, best_low, best_high = error, lows, highs
            continue
        better = error < best_error  # the first (widest) of equal errors stays
        best_error = torch.where(better, error, best_error)
        best_low = torch.where(better, lows, best_low)
        best_high = torch.where(better, highs, best_high)
    return best_low, best_high


def round_to_nearest(weight: torch.Tensor, grid: WeightGrid) -> torch.Tensor:
    """Every weight rounded to its row's (group's) grid (same dtype as ``weight``)."""
    _check_shape(weight, grid)
    rows, columns = weight.shape
    width = grid.group or columns
    blocks = weight.detach().double().reshape(rows * (columns // width), width)
    rounded = _Span(blocks, grid).round_all(blocks)
    return rounded.reshape(rows, columns).to(weight.dtype)


def _inverse_cholesky(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) I)^-1; dead inputs get 1."""
    h = hessian.double().clone()
    dead = torch.diagonal(h) <= 0
    h[dead, dead] = 1.0
    h += damp * torch.diagonal(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    lower = torch.linalg.cholesky(h)
    inverse = torch.cholesky_inverse(lower)
    return torch.linalg.cholesky(inverse, upper=True)


def gptq(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    grid: WeightGrid,
    damp: float = DAMP,
    pin: bool = True,
    act_order: bool = False,
) -> torch.Tensor:
    """``weight`` [out, in] rounded by GPTQ against ``hessian`` [in, in] (sum of x x^T
    over the layer's inputs) onto ``grid``, extremes pinned (module docstring); returns the
    rounded weights (dtype of ``weight``), every row (group) on its grid.

    ``act_order``: the columns are rounded in order of falling diag(H) (the inputs with
    the most energy first, so the error of each lands on quieter ones), every group's
    grid drawn from the weights before any feedback (its columns are rounded at
    scattered times); else left to right, each group's grid drawn when its first column
    comes. ``pin=False``: GPTQ as published, whose rows a backend deriving its grid from
    them may round again."""
    _check_shape(weight, grid)
    columns = weight.shape[1]
    if hessian.shape != (columns, columns):
        raise NpuforgeError(
            f"a Hessian of shape {tuple(hessian.shape)} does not fit a weight of {columns} inputs"
        )
    width = grid.group or columns
    order = torch.arange(columns)
    energy = torch.diagonal(hessian).double()  # weighs each input in a range search
    if act_order:
        order = torch.argsort(torch.diagonal(hessian), descending=True, stable=True)
        spans = [
            _Span(weight.detach().double()[:, g : g + width], grid, pin, energy[g : g + width])
            for g in range(0, columns, width)
        ]
    w = weight.detach().double()[:, order].clone()
    factor = _inverse_cholesky(hessian.double()[order][:, order], damp)
    out = torch.empty_like(w)
    aligned = grid.group and not act_order
    block = max(width, (BLOCK // width) * width) if aligned else BLOCK
    span = None if grid.group else _Span(w, grid, pin, energy[order])
    for start in range(0, columns, block):
        end = min(start + block, columns)
        part, errors = w[:, start:end].clone(), torch.zeros_like(w[:, start:end])
        local = factor[start:end, start:end]
        for j in range(end - start):
            column = int(order[start + j])
            if act_order:
                span = spans[column // width]
            elif grid.group and column % width == 0:
                # The group's grid, from its columns as the feedback has left them.
                span = _Span(part[:, j : j + width], grid, pin, energy[column : column + width])
            rounded = span.round(part[:, j], column % width)
            out[:, start + j] = rounded
            error = (part[:, j] - rounded) / local[j, j]
            part[:, j:] -= error[:, None] * local[j, j:][None, :]
            errors[:, j] = error
        w[:, end:] -= errors @ factor[start:end, end:]
    result = torch.empty_like(out)
    result[:, order] = out
    return result.to(weight.dtype)


def rounding_loss(weight, rounded, hessian) -> float:
    """tr((W - Q) H (W - Q)^T) = ||X W^T - X Q^T||^2 for H = X^T X."""
    delta = (weight.double() - rounded.double()).detach()
    return float(torch.einsum("ri,ij,rj->", delta, hessian.double(), delta))


def fake_quantize_tensor(x: torch.Tensor, low: float, high: float, bits: int = 8) -> torch.Tensor:
    """``x`` rounded to 2^bits levels over [min(low, 0), max(high, 0)] (clipped), zero on
    a level: an activation quantized per tensor with a calibrated range and an integer
    zero point, as the backends' asymmetric quantizers do (onnxruntime's uint8, RKNN's
    asymmetric int8). A zero off the grid would add the same offset to every element,
    and a matmul sums that offset over its whole input."""
    steps = 2**bits - 1
    low, high = min(float(low), 0.0), max(float(high), 0.0)
    scale = max(high - low, 1e-12) / steps
    zero = round(-low / scale)
    levels = torch.clamp(torch.round(x / scale) + zero, 0, steps)
    return (levels - zero) * scale
