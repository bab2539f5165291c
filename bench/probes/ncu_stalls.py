"""Warp-stall samples per SASS instruction from an Nsight Compute report, without Nsight Compute: for a
report that came back from a GPU machine when its ``--page source`` exports did not (too many files).

``fp8_ncu.py`` under ``ncu --set detailed --section SourceCounters`` writes a ``.ncu-rep`` whose results
hold, per kernel, the sampled program counters of every stall reason. The file is a 4-byte magic and a
4-byte version, then blocks of ``[uint32 length][protobuf message]``; a kernel's result message keeps its
metrics in field 13 as ``{1: id, 2: aggregate, 3: [{1: {5: pc}, 2: {5: count}}, ...]}``. The metric ids
of the sampling group were read off one report (Nsight Compute 2025, CUDA 13): 247 the instructions
executed per PC, 261 all samples, then each stall reason and its "not issued" twin in alphabetical order
(checked: the reasons' samples add up to 261's on every kernel of the report). Another Nsight Compute
version may number them differently: the check below fails loudly then.

Run on this machine: ``python3 bench/probes/ncu_stalls.py REPORT.ncu-rep[.gz] KERNEL_SUBSTRING [SASS]`` where
SASS is ``nvdisasm -c`` of the same kernel compiled here for sm_90 (``support.gpu_compile`` with the
probe's config): each sampled PC is then shown with its instruction (offsets from the lowest executed
PC), and every mbarrier wait, named barrier and warp-group MMA wait with its samples. Prints; writes
nothing."""
import gzip
import re
import struct
import sys

REASONS = ("barrier", "branch_resolving", "dispatch_stall", "drain", "imc_miss", "lg_throttle", "long_scoreboard",
           "math_pipe_throttle", "membar", "mio_throttle", "misc", "no_instructions", "not_selected", "selected",
           "short_scoreboard", "sleeping", "tex_throttle", "wait", "warpgroup_arrive")
EXECUTED, SAMPLES = 247, 261
REASON_IDS = {SAMPLES + 1 + 2 * i: name for i, name in enumerate(REASONS)}


def _varint(b: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        c = b[i]
        i += 1
        value |= (c & 0x7F) << shift
        shift += 7
        if not c & 0x80:
            return value, i


def _fields(b: bytes) -> list[tuple[int, object]]:
    """A protobuf message's ``(field, value)`` pairs: ints for varints, bytes for the rest."""
    out, i = [], 0
    while i < len(b):
        key, i = _varint(b, i)
        kind = key & 7
        if kind == 0:
            value, i = _varint(b, i)
        elif kind == 1:
            value, i = b[i:i + 8], i + 8
        elif kind == 5:
            value, i = b[i:i + 4], i + 4
        elif kind == 2:
            size, i = _varint(b, i)
            value, i = b[i:i + size], i + size
        else:
            raise ValueError(f"wire type {kind} at byte {i}")
        out.append((key >> 3, value))
    return out


def results(path: str) -> list[bytes]:
    """The report's top-level messages (``path`` may be gzipped: ``.gz``)."""
    data = (gzip.open if path.endswith(".gz") else open)(path, "rb").read()
    if data[:3] != b"NVR":
        raise ValueError(f"{path} is not an Nsight Compute report")
    blocks, i = [], 10
    while i < len(data):
        (size, ) = struct.unpack("<I", data[i:i + 4])
        blocks.append(data[i + 4:i + 4 + size])
        i += 4 + size
    return blocks


def per_pc(result: bytes) -> dict[int, dict[int, int]]:
    """``{metric id: {pc: count}}`` of one kernel's result."""
    out = {}
    for field, value in _fields(result):
        if field != 13:
            continue
        entry = _fields(value)
        ident = next(v for f, v in entry if f == 1)
        points = [v for f, v in entry if f == 3]
        if len(points) < 20:
            continue
        counts = {}
        for point in points:
            parts = dict(_fields(point))
            key = dict(_fields(parts[1]))
            if 5 not in key:  # not a per-PC metric
                break
            counts[key[5]] = dict(_fields(parts[2])).get(5, 0) if 2 in parts else 0
        else:
            out[ident] = counts
    return out


def main(path: str, kernel: str, sass_path: str | None) -> None:
    found = [b for b in results(path) if kernel.encode() in b[:4000] and len(b) > 100000]
    if not found:
        raise SystemExit(f"no result of a kernel named like {kernel!r} in {path}")
    metrics = per_pc(found[-1])
    total = sum(metrics[SAMPLES].values())
    by_reason = {name: sum(metrics.get(i, {}).values()) for i, name in REASON_IDS.items()}
    if sum(by_reason.values()) != total:
        raise SystemExit("the stall reasons do not add up to the samples: this report numbers its metrics "
                         "differently (see the module docstring)")
    print(f"{total} samples; " + ", ".join(f"{n} {100 * c / total:.1f}%" for n, c in
                                          sorted(by_reason.items(), key=lambda kv: -kv[1]) if c))
    base = min(metrics[EXECUTED])
    sass = {}
    if sass_path:
        for line in open(sass_path):
            m = re.match(r"\s+/\*([0-9a-f]{4,5})\*/\s+(.*?);?\s*$", line)
            if m:
                sass[int(m.group(1), 16)] = m.group(2)
    samples = metrics[SAMPLES]

    def reasons(pc):
        top = sorted(((metrics.get(i, {}).get(pc, 0), n) for i, n in REASON_IDS.items()), reverse=True)[:3]
        return ", ".join(f"{n} {c}" for c, n in top if c)

    print("\nthe 30 most sampled instructions (offset, samples, share, instruction, reasons):")
    for pc, n in sorted(samples.items(), key=lambda kv: -kv[1])[:30]:
        print(f"{pc - base:05x} {n:6d} {100 * n / total:5.1f}%  {sass.get(pc - base, '?')[:64]:64s} {reasons(pc)}")
    if sass:
        print("\nwaits (samples at the wait, and at the branch that repeats it):")
        offsets = sorted(sass)
        for k, off in enumerate(offsets):
            ins = sass[off]
            if any(w in ins for w in ("TRYWAIT", "BAR.SYNC", "DEPBAR")):
                here = samples.get(base + off, 0)
                nxt = samples.get(base + offsets[k + 1], 0) if k + 1 < len(offsets) else 0
                if here + nxt > total // 500:
                    print(f"{off:05x} {here:6d} + {nxt:6d}  {ins[:80]}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
