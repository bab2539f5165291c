"""The flag wait blocks until a concurrent producer publishes, and a missing flag is an error, not a
hang. Runs the real primitives (``tileweave.kernels.sync``) in the interpreter with a producer thread."""

import threading
import time

import torch
import triton
import triton.language as tl

from tileweave.kernels.gemm import _first_tile
from tileweave.kernels.sync import release_add, signal_epoch, wait_epoch


@triton.jit
def _consumer(flag_ptr, data_ptr, out_ptr, err_ptr, epoch, max_spin, BLOCK: tl.constexpr):
    missed = wait_epoch(flag_ptr, epoch, err_ptr, 7, max_spin)
    offs = tl.arange(0, BLOCK)
    vals = tl.load(data_ptr + offs, mask=(offs < BLOCK) & (missed == 0), other=-1.0)
    tl.store(out_ptr + offs, vals)


@triton.jit
def _producer(flag_ptr, data_ptr, epoch, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(data_ptr + offs, offs.to(tl.float32) + epoch)
    signal_epoch(flag_ptr, epoch)


def test_wait_blocks_until_a_concurrent_producer_publishes():
    flag = torch.zeros(1, dtype=torch.int32)
    err = torch.zeros(1, dtype=torch.int32)
    data = torch.full((16,), float("nan"))
    out = torch.zeros(16)
    delay = 0.3

    def produce():
        time.sleep(delay)
        data.copy_(torch.arange(16, dtype=torch.float32) + 5)
        flag[0] = 5  # an aligned 32-bit store, after the data (program order on this thread)

    producer = threading.Thread(target=produce)
    start = time.monotonic()
    producer.start()
    _consumer[(1,)](flag, data, out, err, 5, 10**9, BLOCK=16)
    elapsed = time.monotonic() - start
    producer.join()
    assert elapsed >= delay, "the consumer returned before the producer published"
    assert torch.equal(out, torch.arange(16, dtype=torch.float32) + 5)
    assert err.item() == 0


def test_an_older_epoch_does_not_satisfy_the_wait():
    flag = torch.tensor([4], dtype=torch.int32)  # last call's epoch
    err = torch.zeros(1, dtype=torch.int32)
    out = torch.zeros(16)
    _consumer[(1,)](flag, torch.ones(16), out, err, 5, 50, BLOCK=16)
    assert err.item() == 7, "a stale flag must time out and record the error code"
    assert torch.equal(out, torch.full((16,), -1.0)), "no data may be read after a missed wait"


def test_epochs_compare_cyclically_across_the_int32_wrap():
    err = torch.zeros(1, dtype=torch.int32)
    out = torch.zeros(16)
    wrapped = torch.tensor([-(2**31)], dtype=torch.int32)  # 2**31 - 1 incremented once
    _consumer[(1,)](wrapped, torch.ones(16), out, err, 2**31 - 1, 50, BLOCK=16)
    assert err.item() == 0 and torch.equal(out, torch.ones(16))


def test_signal_publishes_data_before_the_flag():
    flag = torch.zeros(1, dtype=torch.int32)
    data = torch.zeros(16)
    _producer[(1,)](flag, data, 9, BLOCK=16)
    assert flag.item() == 9
    assert torch.equal(data, torch.arange(16, dtype=torch.float32) + 9)


@triton.jit
def _counting_producer(counter_ptr, data_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(data_ptr + tl.program_id(0) * BLOCK + offs, offs.to(tl.float32) + 1)
    release_add(counter_ptr, 1, "sys")


def test_release_add_counts_every_program_after_its_data():
    counter = torch.zeros(1, dtype=torch.int32)
    data = torch.zeros(4 * 16)
    _counting_producer[(4,)](counter, data, BLOCK=16)
    assert counter.item() == 4
    assert torch.equal(data, (torch.arange(16, dtype=torch.float32) + 1).repeat(4))


@triton.jit
def _record_owners(owner_ptr, step, tiles, P: tl.constexpr):
    pid = tl.program_id(0)
    for t in range(_first_tile(pid, step, tiles, P), tiles, P):
        tl.atomic_add(owner_ptr + t, pid + 1)


def test_persistent_programs_take_each_tile_of_a_chunk_once_in_global_order():
    # Global tile g = step * tiles + t belongs to program g % P: every tile of the chunk exactly once, and
    # the chunk's first tile goes to the program after the one that took the previous chunk's last.
    g = torch.Generator().manual_seed(5)
    for _ in range(6):
        tiles = int(torch.randint(1, 200, (1,), generator=g))
        programs = int(torch.randint(1, 50, (1,), generator=g))
        step = int(torch.randint(0, 4, (1,), generator=g))
        owners = torch.zeros(tiles, dtype=torch.int32)
        _record_owners[(programs,)](owners, step, tiles, P=programs)
        assert owners.tolist() == [(step * tiles + t) % programs + 1 for t in range(tiles)], (tiles, programs, step)
