"""Shared random directions for zeroth-order training: one CPU scheme every party regenerates bit for bit.

The scheme (DeComFL and any other seeded-direction algorithm use exactly this):

* A **round seed** is ``derive_seed(run_seed, round, "zo-round")``: a 63-bit integer, sent on the wire
  as ``uint64`` (one per round; the K x P directions of the round derive from it).
* Direction ``z(round_seed, k, p)`` for local step ``k`` and perturbation ``p`` comes from ONE numpy
  PCG64 generator, ``protocols.seeding.rng(round_seed, k, p, "zo-direction")``, that walks the
  parameters **in model order** (the order of the parameter dict, i.e. torch ``named_parameters``)
  and draws, for each tensor of ``n`` values, ``standard_normal(n, dtype=float32)`` (``gaussian``) or
  ``2 * integers(0, 2, n, dtype=int8) - 1`` as float32 (``rademacher``), reshaped to the tensor.
* A local step ``k`` moves along its **update direction** ``u = sum_p c_p z_p``: one float32 vector over the
  parameters in model order, accumulated from zero with p ascending (``u += c_p * z_p``, each product rounded to
  float32, then the sum; a zero ``c_p`` is skipped). Every party computes ``u`` with :func:`update` and applies
  it whole, so replaying a round costs a few vector operations, not P of them: a process computes each round's
  ``u`` once and shares it (the cloud's step, every device catching up; least recently used dropped first).
* A plain step is ``x -= u`` with ``c_p = float32((lr / P) * g_p)`` (``lr / P * g_p`` computed in float64,
  then rounded once to float32; :func:`step_coefficients`, :func:`apply_step`).
* With **momentum** beta > 0 (torch's heavy ball, which the DeComFL repository runs: its SGD steps on the
  ZO estimate), a step keeps a buffer ``b`` beside ``x``: ``c_p = float32(g_p / P)``, then ``b *= float32(beta)``,
  ``b += u``, ``x -= float32(lr) * b`` (:func:`apply_momentum_step`). The buffer is part of the global
  trajectory: a device reverts it with ``x`` after its local steps and replays it with ``x`` when it catches
  up, so both stay bit-identical to the cloud's.
* Local steps, catch-up replay and the cloud's model all step through :func:`apply_step` /
  :func:`apply_momentum_step` (rounds oldest first, k ascending), so the operation order and rounding are the
  same everywhere; every operation is an elementwise, correctly rounded IEEE float32 multiply, add or
  subtract (no fused multiply-add), so the result does not depend on the machine, nor on whether the
  parameters are held as one vector (:func:`packed`, the fast path) or tensor by tensor.

* **Replay shared within a process**: every replica that applied the same rounds from the same x_0 holds the same
  bits (the point of the scheme), so a process keeps the last states reached (:func:`replay`), keyed by a hash
  chain over x_0, the settings and each round's seed and scalars (:func:`trajectory_key`, :func:`next_key`): a
  device catching up takes the newest state of its chain some party of the process already computed (shared,
  read-only, where it is the state it needs) and replays only the rounds after it, into its own copy (bit for bit
  what replaying all of them gives).

:func:`fingerprint` hashes a small direction: parties can compare it at start-up to catch a numpy
whose generator stream differs.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from collections.abc import Mapping, MutableMapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, TypeVar, cast

import numpy as np

from .packed import Packed as Packed
from .packed import Shaped as Shaped
from .packed import Shapes as Shapes
from .packed import frozen, shapes_key, views, writable
from .packed import packed as packed
from .packed import shapes_of as shapes_of
from .seeding import derive_seed, rng

Kind = Literal["gaussian", "rademacher"]
KINDS: tuple[str, ...] = ("gaussian", "rademacher")


def round_seed(run_seed: int, round: int) -> int:
    """The seed the cloud picks for ``round`` (the directions of all its steps derive from it)."""
    return derive_seed(run_seed, round, "zo-round")


CACHE_BYTES = 64 << 20  # directions kept for reuse within a process (bounds memory)
UPDATE_CACHE_BYTES = 64 << 20  # update directions u kept for reuse (one a round-step: P times smaller)
STATE_CACHE_BYTES = 16 << 20  # replayed states (x and its momentum buffer) kept for the process's other replicas
_cache: OrderedDict[tuple, tuple[np.ndarray, dict[str, np.ndarray]]] = OrderedDict()  # key -> (flat, views)
_cached_bytes = 0
_updates: OrderedDict[tuple, np.ndarray] = OrderedDict()
_update_bytes = 0
_states: OrderedDict[bytes, tuple[Packed, Packed | None]] = OrderedDict()  # chain key -> (x, buffer), read-only
_state_bytes = 0
_lock = threading.Lock()  # agents may run as threads of one process (fedtier run)
_draw_threads = 1  # runtime.direction_threads: threads that draw a step's P directions (set_draw_threads)
_pool: ThreadPoolExecutor | None = None
_step: tuple[OrderedDict, tuple, tuple[np.ndarray, ...]] | None = None  # the last step's directions (its cache, key)
_ahead: ThreadPoolExecutor | None = None  # the thread that draws ahead (set_prefetch), None: off
_pending: dict[tuple, Future] = {}  # a step -> its draw ahead, while it runs
_newest: tuple | None = None  # the state kept last: (its key, its last round's seed and scalars, lr, kind, momentum)
_replaying: dict[bytes, Future] = {}  # a state replayed ahead (protocols.replay_ahead) -> its end, while it runs


def _remember(cache: OrderedDict, key: Any, value: Any, size: int, budget: int, used: int) -> int:
    """Put ``value`` (``size`` bytes) in ``cache`` unless there, drop the oldest past ``budget``: bytes used."""
    if key not in cache and size <= budget:
        cache[key] = value
        used += size
    while used > budget and cache:
        _, old = cache.popitem(last=False)
        used -= sum(_nbytes(a) for a in old) if isinstance(old, tuple) else _nbytes(old)
    return used


def _nbytes(value: Any) -> int:
    """The bytes of a cached vector or :class:`Packed` state (0 for what goes with them: views by name, no buffer)."""
    return value.flat.nbytes if isinstance(value, Packed) else value.nbytes if isinstance(value, np.ndarray) else 0


def direction(round_seed: int, k: int, p: int, shapes: Shaped, kind: Kind = "gaussian") -> dict[str, np.ndarray]:
    """z(round_seed, k, p): float32 arrays of ``shapes``, drawn in the order of ``shapes``; read-only.

    Every device of a round (and its cell, and the cloud) needs the same directions: a process draws each once and
    hands out the same arrays while they fit in ``CACHE_BYTES`` (least recently used dropped first)."""
    flat, named = _direction(round_seed, k, p, shapes, kind)
    if len(named) < len(shapes):  # its views made at the first call only (the steps read the vector)
        named.update(views(flat, shapes))
    return dict(named)


def direction_vector(round_seed: int, k: int, p: int, shapes: Shaped, kind: Kind = "gaussian") -> np.ndarray:
    """z(round_seed, k, p) as one read-only float32 vector (the tensors of ``shapes`` in order)."""
    return _direction(round_seed, k, p, shapes, kind)[0]


def _direction(
    round_seed: int,
    k: int,
    p: int,
    shapes: Shaped,
    kind: Kind,
    into: np.ndarray | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """z(round_seed, k, p) as kept (``_cache``), else drawn (into ``into``, a row of a step's block, if given), kept."""
    global _cached_bytes
    key = (int(round_seed), int(k), int(p), kind, shapes_key(shapes))
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    flat = _draw_flat(int(round_seed), int(k), int(p), shapes, kind, into)
    flat.flags.writeable = False
    out: tuple[np.ndarray, dict[str, np.ndarray]] = (flat, {})  # (views by name: direction() makes them once)
    with _lock:
        _cached_bytes = _remember(_cache, key, out, flat.nbytes, CACHE_BYTES, _cached_bytes)
    return out


def set_draw_threads(n: int) -> None:
    """Draw a step's missing directions in up to ``n`` threads (``runtime.direction_threads``; process-wide, as
    the directions' cache is). Each direction has its own generator and numpy's draws release the GIL: the same
    bits as one thread, less wall time on free cores."""
    global _draw_threads, _pool
    n = max(1, int(n))
    with _lock:
        if n != _draw_threads and _pool is not None:
            _pool.shutdown(wait=False)
            _pool = None
        _draw_threads = n


def set_prefetch(on: bool) -> None:
    """Whether :func:`prefetch` draws ahead in this process (``fedtier sim``'s processes, whose roles and devices draw
    the same directions later: a cloud at the round's end, the devices of a cell in the same process)."""
    global _ahead
    with _lock:
        if not on and _ahead is not None:
            _ahead.shutdown(wait=False)
        _ahead = (_ahead or ThreadPoolExecutor(1, thread_name_prefix="zo-ahead")) if on else None


def prefetching() -> bool:
    """Whether :func:`prefetch` draws ahead in this process (:func:`set_prefetch`)."""
    return _ahead is not None


def prefetch(round_seed: int, steps: int, count: int, shapes: Shaped, kind: Kind = "gaussian") -> None:
    """Start drawing the ``count`` directions of each of a round's ``steps`` steps in a thread of their own where
    :func:`set_prefetch` allows: who asks for one meanwhile (:func:`direction_vectors`) waits for its step's draw."""
    shapes = shapes if isinstance(shapes, Shapes) else Shapes(shapes)
    for k in range(steps):
        step = (int(round_seed), k, int(count), kind, shapes.key)
        with _lock:
            if _ahead is None or step in _pending or (int(round_seed), k, 0, kind, shapes.key) in _cache:
                continue
            try:  # (registered once taken: its draw's end pops it under this lock)
                _ahead.submit(_draw_ahead, step, shapes, ahead := Future[tuple]())
            except RuntimeError:  # its executor shut down (the interpreter exiting): drawn when asked
                return
            _pending[step] = ahead


def _draw_ahead(step: tuple, shapes: Shapes, ahead: Future) -> None:
    try:
        ahead.set_result(tuple(_draw_step(step, shapes)))
    except BaseException as exc:  # (the one who asks for it raises it)
        ahead.set_exception(exc)
    finally:
        with _lock:
            _pending.pop(step, None)


def direction_vectors(round_seed: int, k: int, count: int, shapes: Shaped, kind: Kind = "gaussian") -> list[np.ndarray]:
    """z(round_seed, k, p) for p = 0..count-1 (:func:`direction_vector` each); those not cached yet are drawn
    in up to :func:`set_draw_threads` threads (this one and the pool's, a share each), bit-identical to drawing
    them one by one. A step none of whose directions is kept yet is drawn as the rows of one read-only
    ``(count, n)`` block, which :func:`stacked` hands out whole (its rows are kept, used and dropped together). The
    last step asked for is handed out again without a look-up (every device of a round asks for it in turn); a step
    being drawn ahead (:func:`prefetch`) is waited for."""
    step, last = (int(round_seed), int(k), count, kind, shapes_key(shapes)), _step
    if last is not None and last[0] is _cache and last[1] == step:  # every device of a round asks for the same ones
        return list(last[2])
    ahead = _pending.get(step)
    return list(ahead.result()) if ahead is not None else _draw_step(step, shapes)


def _draw_step(step: tuple, shapes: Shaped) -> list[np.ndarray]:
    """:func:`direction_vectors` of ``step`` = (seed, k, count, kind, the shapes' key), looked up or drawn."""
    global _pool, _step
    seed, k, count, kind, key = step
    with _lock:  # looked up at once, under one lock
        hits = [_cache.get((seed, k, p, kind, key)) for p in range(count)]
        for p, hit in enumerate(hits):
            if hit is not None:
                _cache.move_to_end((seed, k, p, kind, key))
    out = [hit[0] if hit is not None else None for hit in hits]
    missing = [p for p, z in enumerate(out) if z is None]
    if not missing:
        _step = (_cache, step, cast(tuple[np.ndarray, ...], tuple(out)))
        return out  # type: ignore[return-value]
    size = shapes.size if isinstance(shapes, Shapes) else Shapes(shapes).size
    block = np.empty((count, size), np.float32) if len(missing) == count > 1 else None

    def draw(ps: list[int]) -> None:
        for p in ps:
            out[p] = _direction(seed, k, p, shapes, kind, block[p] if block is not None else None)[0]

    n = 1
    if _draw_threads > 1 and len(missing) > 1:
        with _lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(_draw_threads - 1, thread_name_prefix="zo-draw")
            pool, n = _pool, min(_draw_threads, len(missing))
    if n > 1:
        shares = [pool.submit(draw, missing[i::n]) for i in range(1, n)]
        draw(missing[0::n])
        for share in shares:
            share.result()
    else:
        draw(missing)
    if block is not None:
        block.flags.writeable = False
    _step = (_cache, step, cast(tuple[np.ndarray, ...], tuple(out)))
    return out  # type: ignore[return-value]


def stacked(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """``vectors`` (float32, of one size) as one ``(len, n)`` array: the read-only block they were drawn as the rows
    of, in order (:func:`direction_vectors`: no copy), else a stack of them (a copy)."""
    block = vectors[0].base if vectors else None
    if isinstance(block, np.ndarray) and block.ndim == 2 and block.dtype == np.float32 and not block.flags.writeable:
        at, step = block.ctypes.data, block.strides[0]  # (rows of a block: views of it, one after another)
        if len(vectors) == block.shape[0] and all(
            z.base is block and z.ctypes.data == at + i * step for i, z in enumerate(vectors)
        ):
            return block
    return np.stack(vectors)


def _draw_flat(
    round_seed: int, k: int, p: int, shapes: Shaped, kind: Kind, out: np.ndarray | None = None
) -> np.ndarray:
    gen = rng(round_seed, k, p, "zo-direction")
    sizes = [math.prod(shape) for shape in shapes.values()]
    out = np.empty(sum(sizes), np.float32) if out is None else out
    if kind == "gaussian":  # one call: a float32 normal draw goes on where the last one ended (as a call per tensor)
        return gen.standard_normal(len(out), dtype=np.float32, out=out)
    if kind != "rademacher":
        raise ValueError(f"unknown direction kind {kind!r} (choose {', '.join(KINDS)})")
    at = 0
    for n in sizes:  # one generator walks the tensors in order (a call per tensor: rademacher's draw is buffered)
        out[at : at + n] = 2 * gen.integers(0, 2, n, dtype=np.int8) - 1
        at += n
    return out


def perturbed(params: Mapping[str, np.ndarray], z: Mapping[str, np.ndarray], mu: float) -> dict[str, np.ndarray]:
    """``x + mu * z`` as new float32 arrays (``params`` is not touched)."""
    m = np.float32(mu)
    return {k: (v + m * z[k]).astype(np.float32, copy=False) for k, v in params.items()}


def step_coefficients(lr: float, g: np.ndarray) -> np.ndarray:
    """``c_p = float32((lr / P) * g_p)`` for the P scalars ``g`` (``lr / P * g_p`` in float64, rounded once to
    float32): the one rounding every party applies."""
    g = np.asarray(g, np.float64)
    return (float(lr) / g.shape[0] * g).astype(np.float32)


def update(
    round_seed: int,
    k: int,
    c: np.ndarray,
    shapes: Shaped,
    kind: Kind = "gaussian",
    share: bool = True,
) -> np.ndarray:
    """u = sum_p c[p] z(round_seed, k, p) as one read-only float32 vector (see the module docstring for the
    order). ``share``: keep it for the process's other parties (a round's global step: the cloud and every
    device replaying it); a device's own local step is not shared."""
    global _update_bytes
    c = np.asarray(c, np.float32)
    key = (int(round_seed), int(k), c.tobytes(), kind, shapes_key(shapes))
    if share:
        with _lock:
            hit = _updates.get(key)
            if hit is not None:
                _updates.move_to_end(key)
                return hit
    u = np.zeros(shapes.size if isinstance(shapes, Shapes) else Shapes(shapes).size, np.float32)
    product = np.empty_like(u)  # each c_p z_p written here, then added: the same float32 product and sum
    for p, z in enumerate(direction_vectors(round_seed, k, c.shape[0], shapes, kind)):  # (looked up at once)
        if c[p] != 0:
            u += np.multiply(z, c[p], out=product)
    u.flags.writeable = False
    if share:
        with _lock:
            _update_bytes = _remember(_updates, key, u, u.nbytes, UPDATE_CACHE_BYTES, _update_bytes)
    return u


def _pairs(params: Mapping[str, np.ndarray], u: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """(array, its part of ``u``): the whole vector for :class:`Packed` parameters, else tensor by tensor."""
    if isinstance(params, Packed):
        return [(params.flat, u)]
    return list(zip(params.values(), views(u, shapes_of(params)).values()))


def apply_step(
    params: MutableMapping[str, np.ndarray],
    round_seed: int,
    k: int,
    g: np.ndarray,
    lr: float,
    kind: Kind = "gaussian",
    share: bool = True,
) -> None:
    """In place: ``x -= u`` with ``c_p = float32((lr / P) * g[p])`` (``g`` holds P scalars)."""
    u = update(round_seed, k, step_coefficients(lr, g), shapes_of(params), kind, share)
    for v, part in _pairs(params, u):
        v -= part


def apply_momentum_step(
    params: MutableMapping[str, np.ndarray],
    buf: MutableMapping[str, np.ndarray],
    round_seed: int,
    k: int,
    g: np.ndarray,
    lr: float,
    momentum: float,
    kind: Kind = "gaussian",
    share: bool = True,
) -> None:
    """In place, heavy ball on the ZO estimate: ``b = beta * b + u`` (``c_p = float32(g[p] / P)``), ``x -= lr * b``."""
    g = np.asarray(g, np.float64)
    c = (g / g.shape[0]).astype(np.float32)  # float32(g[p] / P), each g[p] exact in float64
    u = update(round_seed, k, c, shapes_of(params), kind, share)
    beta, rate = np.float32(momentum), np.float32(lr)
    flat = isinstance(params, Packed) and isinstance(buf, Packed)
    xs = [params.flat] if flat else list(params.values())  # type: ignore[attr-defined]
    bs = [buf.flat] if flat else [buf[name] for name in params]  # type: ignore[attr-defined]
    us = [u] if flat else list(views(u, shapes_of(params)).values())
    for x, b, part in zip(xs, bs, us):
        b *= beta
        b += part
        x -= rate * b


def apply_round(
    params: MutableMapping[str, np.ndarray],
    round_seed: int,
    g: np.ndarray,
    lr: float,
    kind: Kind = "gaussian",
    buf: MutableMapping[str, np.ndarray] | None = None,
    momentum: float = 0.0,
) -> None:
    """In place: one round's global update from its K x P averaged scalars (k ascending); with
    ``momentum`` > 0 the heavy-ball buffer ``buf`` is stepped too."""
    for k in range(g.shape[0]):
        if momentum:
            assert buf is not None, "momentum needs its buffer"
            apply_momentum_step(params, buf, round_seed, k, g[k], lr, momentum, kind)
        else:
            apply_step(params, round_seed, k, g[k], lr, kind)


def trajectory_key(
    params: Packed, buf: Packed | None, lr: float, momentum: float, kind: Kind = "gaussian"
) -> bytes | None:
    """The key of the state ``params`` (and momentum buffer ``buf``) for :func:`replay`: a hash of its bytes, its
    shapes and the step's settings (what, with the rounds applied after it, determines every later state); None
    for a state larger than ``STATE_CACHE_BYTES`` (never kept: its replicas replay every round themselves)."""
    if params.flat.nbytes + (buf.flat.nbytes if buf is not None else 0) > STATE_CACHE_BYTES:
        return None
    h = hashlib.blake2b(repr((float(lr), float(momentum), kind, params.shapes.key)).encode(), digest_size=16)
    h.update(params.flat.data)
    if buf is not None:
        h.update(buf.flat.data)
    return h.digest()


def next_key(key: bytes, round_seed: int, g: np.ndarray) -> bytes:
    """The key of the state that applying the round (``round_seed``, scalars ``g``: K x P, its shape hashed too, as
    the same bytes in another shape are other steps and directions) to the state ``key`` gives."""
    return _chain(key, np.array([round_seed], np.uint64), np.asarray(g)[None])[0]


State = TypeVar("State", bound=MutableMapping[str, np.ndarray])


def _chain(key: bytes, seeds: np.ndarray, hist: np.ndarray) -> list[bytes]:
    """The key of the state after each round (``seeds[i]``, ``hist[i]``) applied in turn from ``key`` (:func:`next_key`
    is one round of it): the rounds' shape, seeds and scalars turned into bytes once for them all, not once a round."""
    if len(hist) == 0:
        return []
    g, s = np.ascontiguousarray(hist, "<f4").tobytes(), np.ascontiguousarray(seeds, "<u8").tobytes()
    w, shape = len(g) // len(hist), b"".join(int(n).to_bytes(8, "little") for n in hist.shape[1:])
    keys, at, blake2b = [], key, hashlib.blake2b  # (a round's bytes are slices of the two: no array a round)
    for i in range(min(len(hist), len(s) // 8)):
        at = blake2b(b"".join((at, s[8 * i : 8 * i + 8], shape, g[w * i : w * i + w])), digest_size=16).digest()
        keys.append(at)
    return keys


def replay(
    params: State,
    buf: State | None,
    key: bytes | None,
    seeds: np.ndarray,
    hist: np.ndarray,
    lr: float,
    kind: Kind = "gaussian",
    momentum: float = 0.0,
    ahead: bool = False,
) -> tuple[State, State | None, bytes | None]:
    """The rounds (``seeds[i]``, ``hist[i]``) applied in order to the state ``params``, ``buf`` of key ``key``
    (:func:`apply_round`): the state reached (parameters, buffer) and its key, for the caller to hold from now on.
    The newest state of the chain that this process reached before (any replica of the same run) is taken instead of
    replayed, and the state reached is kept for the others (``STATE_CACHE_BYTES``, least recently used dropped
    first): the same bits as replaying every round. A state reached before is handed out as it is kept, read-only
    and shared by the replicas that reached it (no copy a replica a round); a replica that goes on from it replays
    into its own copy, which is kept as it is and which it then holds read-only too (the replicas at x_r all hold one
    array: the cohort engine's one-point probes see the same array, not equal ones to compare). ``params`` and ``buf``
    are given up (their caller holds what is returned instead). Without a key (:func:`trajectory_key` gave none) or
    :class:`Packed` parameters, every round is replayed in place; None returned as the key. A state being replayed
    ahead (``protocols.replay_ahead``, which passes ``ahead``) is waited for, then taken as kept."""
    global _state_bytes, _newest
    if key is None or not isinstance(params, Packed) or not isinstance(buf, Packed | None):
        for s, g in zip(seeds, hist):
            apply_round(params, int(s), g, lr, kind, buf, momentum)
        return params, buf, None
    keys = _chain(key, seeds, hist)
    if keys and not ahead and (running := _replaying.get(keys[-1])) is not None:
        running.exception()  # (its end: the state kept, or its failure, after which this replays it itself)
    start, hit = 0, None
    with _lock:
        for j in range(len(keys) - 1, -1, -1):
            if (hit := _states.get(keys[j])) is not None:
                _states.move_to_end(keys[j])
                start = j + 1
                break
    if not keys:
        return params, buf, key
    if hit is not None and start == len(keys) and (buf is None) == (hit[1] is None):  # reached before: shared
        return cast(State, hit[0]), cast("State | None", hit[1]), keys[-1]
    own = writable(params, hit[0].flat if hit is not None else None)
    own_buf = (
        writable(buf, hit[1].flat if hit is not None and hit[1] is not None else None) if buf is not None else None
    )
    for i in range(start, len(keys)):
        apply_round(own, int(seeds[i]), hist[i], lr, kind, own_buf, momentum)
    size = own.flat.nbytes + (own_buf.flat.nbytes if own_buf is not None else 0)
    if size <= STATE_CACHE_BYTES:  # kept as it is, read-only from now on: the replica holds the kept state too
        state = (frozen(own), frozen(own_buf) if own_buf is not None else None)
        last = len(keys) - 1  # (the newest state: where a round replayed ahead starts, protocols.replay_ahead)
        with _lock:
            _state_bytes = _remember(_states, keys[-1], state, size, STATE_CACHE_BYTES, _state_bytes)
            _newest = (keys[-1], int(seeds[last]), np.asarray(hist[last]).tobytes(), lr, kind, momentum)
        own, own_buf = state
    return cast(State, own), cast("State | None", own_buf), keys[-1]


def fingerprint(kind: Kind = "gaussian") -> str:
    """A short hash of z(123, 0, 0) over a (4, 4) tensor: equal on every party that agrees on the scheme."""
    z = direction(123, 0, 0, {"w": (4, 4)}, kind)["w"]
    return hashlib.sha256(z.astype("<f4").tobytes()).hexdigest()[:16]
