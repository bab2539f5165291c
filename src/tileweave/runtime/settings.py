"""Every environment variable that changes what tileweave does, read here and nowhere else.

==================================  =========  ==============================================================
variable                            default    what it sets
==================================  =========  ==============================================================
``TILEWEAVE_POLICY``                ``auto``   the policy of every op built with ``policy="auto"`` (the ops'
                                               common names: ``fused``, ``oneshot``, ``fallback``; an op
                                               without that policy refuses it, naming this variable)
``TILEWEAVE_AG_TRANSPORT``          op's       the transport of the shared ``AllGatherGemm`` (``mesh``,
                                               ``ring``, ``chunked``, ``auto``)
``TILEWEAVE_RS_TRANSPORT``          op's       the transport of the shared ``GemmReduceScatter``
``TILEWEAVE_AG_STREAM_K``           unset      1/0: the shared ``AllGatherGemm``'s ``stream_k``
``TILEWEAVE_RS_PULL``               unset      1/0: the shared ``GemmReduceScatter``'s ``pull``
``TILEWEAVE_GRAPHABLE``             0          1: the shared ops (functional API, TP layers) are graphable
``TILEWEAVE_DEBUG``                 0          1: every call waits for its GPU work (bounded) and reports an
                                               expired wait at once instead of at the next call
``TILEWEAVE_MAX_SPIN``              backend's  polls an in-kernel flag wait may take before it reports a
                                               lost peer
``TILEWEAVE_TIMEOUT_S``             60         seconds a host-side wait for a peer may take (GPUs): the
                                               agreement before a call (not counting a peer's first
                                               compile of a call's kernels), a debug-mode synchronisation
``TILEWEAVE_EMULATED_TIMEOUT_S``    60         the same for emulated CPU ranks
``TILEWEAVE_FAST_LAUNCH``           1          0: every launch through Triton's public ``kernel[grid]``
``TILEWEAVE_CACHE_DIR``             home       where tuned kernel configs are kept (``~/.cache/tileweave``)
==================================  =========  ==============================================================

The shared ops (one per group and device, used by the functional API and the TP layers) read their
settings when they are made; ops built by the caller take their arguments, but for
``TILEWEAVE_POLICY``, which replaces ``"auto"`` everywhere. ``TILEWEAVE_DEBUG`` is read at every call.
The emulated ranks' own variables (``TILEWEAVE_EMULATED_HEAP``, ``..._HEAP_BYTES``, ``..._ONE_QUEUE``,
``..._HOSTS``) are set by ``tileweave.testing.run_ranks`` for its ranks, not by users.
"""

from __future__ import annotations

import os

POLICY = "TILEWEAVE_POLICY"
AG_TRANSPORT = "TILEWEAVE_AG_TRANSPORT"
RS_TRANSPORT = "TILEWEAVE_RS_TRANSPORT"
AG_STREAM_K = "TILEWEAVE_AG_STREAM_K"
RS_PULL = "TILEWEAVE_RS_PULL"
GRAPHABLE = "TILEWEAVE_GRAPHABLE"
DEBUG = "TILEWEAVE_DEBUG"
MAX_SPIN = "TILEWEAVE_MAX_SPIN"
TIMEOUT_S = "TILEWEAVE_TIMEOUT_S"
EMULATED_TIMEOUT_S = "TILEWEAVE_EMULATED_TIMEOUT_S"
FAST_LAUNCH = "TILEWEAVE_FAST_LAUNCH"
CACHE_DIR = "TILEWEAVE_CACHE_DIR"


_overrides: dict[str, str] = {}


def override(name: str, value: str | None) -> None:
    """Set tileweave's setting ``name`` for this process as the variable would, over the environment
    (None: back to the environment's value). For entry points whose options are settings (the CLI's
    ``--policy``, ``generate --cuda-graph``); libraries pass arguments to the ops instead. Read where the
    variable is read: the shared ops take their settings when they are made."""
    if value is None:
        _overrides.pop(name, None)
    else:
        _overrides[name] = value


def export(values: dict[str, str]) -> list[str]:
    """Put ``values`` into this process's environment, where other libraries (NCCL, torch's symmetric
    memory, torch.distributed's rendezvous) and the processes it starts read them: the one place tileweave
    writes the environment. Returns a note for each variable that held another value."""
    notes = []
    for key, value in values.items():
        if os.environ.get(key) not in (None, value):
            notes.append(f"{key}={os.environ[key]} overridden to {value}")
        os.environ[key] = value
    return notes


def text(name: str) -> str | None:
    """The setting's value (an ``override``, else the variable's), None when it is unset or empty."""
    return _overrides.get(name) or os.environ.get(name) or None


def flag(name: str, default: bool = False) -> bool:
    """Whether the variable is set to something other than 0 (``default`` when unset or empty)."""
    value = text(name)
    return default if value is None else value != "0"


def optional_flag(name: str) -> bool | None:
    """The variable as a flag, None when it is unset or empty (the option keeps its own default)."""
    value = text(name)
    return None if value is None else value != "0"


def number(name: str, default: float) -> float:
    """The variable as a number (``default`` when unset or empty); a value that is not one raises,
    naming the variable."""
    value = text(name)
    if value is None:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number") from None


TIMEOUT_DEFAULT_S = 60.0
"""``TILEWEAVE_TIMEOUT_S`` when unset. A rank's first compile of a call's kernels (seconds to a minute
with a cold cache) does not count against it: a peer's wait for a rank that is in a signature's first
call, after its agreement, starts again when that call ends (``tileweave.runtime.agreement.first_call``),
and a kernel's first launch meets the other ranks after compiling, before it spins on their flags
(``tileweave.ops.skeleton.first_launch``). What remains is a straggler's lead, milliseconds, so a
minute reports a missing peer without mistaking a slow one for it."""
EMULATED_TIMEOUT_DEFAULT_S = 60.0


def timeout_s() -> float:
    """``TILEWEAVE_TIMEOUT_S``: the host's bound on a wait for a peer on GPUs, in seconds."""
    return number(TIMEOUT_S, TIMEOUT_DEFAULT_S)


def emulated_timeout_s() -> float:
    """``TILEWEAVE_EMULATED_TIMEOUT_S``: the same bound for emulated CPU ranks."""
    return number(EMULATED_TIMEOUT_S, EMULATED_TIMEOUT_DEFAULT_S)


def max_spin(default: int) -> int:
    """``TILEWEAVE_MAX_SPIN`` as a positive int, ``default`` when unset."""
    value = number(MAX_SPIN, default)
    if value < 1 or value != int(value):
        raise ValueError(f"{MAX_SPIN}={text(MAX_SPIN)!r} must be a positive integer")
    return int(value)


def policy() -> str:
    """The policy that replaces ``"auto"``: ``TILEWEAVE_POLICY``, or ``"auto"`` when it is unset (the
    op checks it against its policies and names this variable if it has no such policy)."""
    return text(POLICY) or "auto"


def debug() -> bool:
    """``TILEWEAVE_DEBUG=1``: every call waits for its GPU work (bounded) and reports an expired wait at
    once instead of at the next call."""
    return flag(DEBUG)
