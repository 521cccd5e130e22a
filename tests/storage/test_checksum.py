"""CRC32C: combining the CRCs of two blocks, appending a block by its CRC, the copy-free
hardware path over every kind of buffer (with the GIL released), and the encoded form, against
direct computation with another library (google-crc32c)."""

from __future__ import annotations

import array
import functools

import google_crc32c
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import backends_with
from zephon.storage import checksum
from zephon.storage.checksum import (
    Crc32c,
    crc32c_combine,
    crc32c_extend,
    crc32c_of,
    decode_crc32c,
    encode_crc32c,
)

blocks = st.binary(max_size=4096)
crcs = st.integers(min_value=0, max_value=0xFFFFFFFF)


def direct(data: bytes) -> int:
    return google_crc32c.value(data)


# -- combine against direct computation -----------------------------------------------------------


@given(blocks, blocks)
def test_combining_two_blocks_gives_the_crc_of_their_concatenation(a, b):
    assert crc32c_combine(direct(a), direct(b), len(b)) == direct(a + b)


@given(blocks)
def test_an_empty_block_on_either_side_changes_nothing(a):
    assert crc32c_combine(direct(a), direct(b""), 0) == direct(a)
    assert crc32c_combine(direct(b""), direct(a), len(a)) == direct(a)


@given(st.lists(blocks, max_size=8))
def test_a_running_crc_extended_block_by_block_equals_one_pass(parts):
    running = Crc32c()
    for part in parts:
        running.extend(direct(part), len(part))
    whole = b"".join(parts)
    assert (running.value, running.size) == (direct(whole), len(whole))
    assert running.encoded() == crc32c_of(whole)


@given(blocks, blocks, blocks)
def test_update_and_extend_mix_in_any_order(a, b, c):
    running = Crc32c()
    running.update(a)
    running.extend(direct(b), len(b))
    running.update(memoryview(c))
    assert running.value == direct(a + b + c)
    assert running.size == len(a) + len(b) + len(c)


# -- large lengths, through zero-block identities -------------------------------------------------
#
# The CRC of n zero bytes can be built from smaller zero blocks in many ways; every way must give
# the same value, and where n is small enough to checksum, the value computed directly.


@functools.cache
def zeros_crc(n: int) -> int:
    """CRC32C of n zero bytes by binary splitting: z(2m) = combine(z(m), z(m), m)."""
    if n <= 4096:
        return direct(bytes(n))
    half = n // 2
    return crc32c_combine(
        crc32c_combine(zeros_crc(half), zeros_crc(half), half), zeros_crc(n % 2), n % 2
    )


def zeros_crc_directly(n: int, crc: int = 0, piece: int = 64 << 20) -> int:
    """``crc`` extended by n zero bytes, checksummed piece by piece from one zero buffer."""
    zero = memoryview(bytes(min(n, piece)))
    for start in range(0, n, piece):
        crc = crc32c_extend(crc, zero[: min(piece, n - start)])
    return crc


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 1 << 62), st.integers(0, 1 << 62), st.binary(max_size=64))
def test_zero_blocks_of_any_length_combine_associatively(m, n, head):
    # (head || 0^m) || 0^n  ==  head || (0^m || 0^n)  ==  head || 0^(m+n)
    left = crc32c_combine(crc32c_combine(direct(head), zeros_crc(m), m), zeros_crc(n), n)
    right = crc32c_combine(direct(head), crc32c_combine(zeros_crc(m), zeros_crc(n), n), m + n)
    assert left == right == crc32c_combine(direct(head), zeros_crc(m + n), m + n)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 24 << 20))
def test_zero_blocks_built_by_combining_match_direct_computation(n):
    assert zeros_crc(n) == zeros_crc_directly(n)


@pytest.mark.parametrize("n", [(1 << 29) + 3, (1 << 32) + 12345])
def test_lengths_whose_bit_count_exceeds_32_bits_are_exact(n):
    # 8 * n >= 2^32: a table of x^(2^k) that wrapped k at 32 (as zlib may for CRC-32, whose
    # polynomial is irreducible) would be wrong here, since CRC32C's polynomial is not.
    head = b"zephon"
    expected = zeros_crc_directly(n, crc=direct(head))
    assert crc32c_combine(direct(head), zeros_crc(n), n) == expected
    running = Crc32c()
    running.update(head)
    running.extend(zeros_crc(n), n)
    assert (running.value, running.size) == (expected, len(head) + n)


def test_combine_refuses_values_that_are_not_crcs_or_lengths():
    with pytest.raises(ValueError, match="len_b"):
        crc32c_combine(0, 0, -1)
    with pytest.raises(ValueError, match="32-bit"):
        crc32c_combine(1 << 32, 0, 1)
    with pytest.raises(ValueError, match="32-bit"):
        crc32c_combine(0, -1, 1)


@given(crcs, crcs, st.integers(1, 1 << 40))
def test_combine_is_linear_in_the_first_crc(a, b, n):
    # crc(A||B) depends on crc(A) through a multiplication: xor-ing two first CRCs xors results
    assert crc32c_combine(a, 0, n) ^ crc32c_combine(b, 0, n) == crc32c_combine(a ^ b, 0, n)
    assert crc32c_combine(a, b, n) == crc32c_combine(a, 0, n) ^ b


# -- every kind of buffer, copy-free --------------------------------------------------------------


@given(st.binary(max_size=2048), st.integers(0, 64), st.integers(0, 64))
def test_every_buffer_kind_gives_the_same_crc(data, cut_front, cut_back):
    inner = data[cut_front : max(cut_front, len(data) - cut_back)]
    expected = direct(inner)
    view = memoryview(data)[cut_front : max(cut_front, len(data) - cut_back)]
    assert crc32c_extend(0, inner) == expected
    assert crc32c_extend(0, view) == expected  # a read-only slice, not copied
    assert crc32c_extend(0, bytearray(inner)) == expected
    assert crc32c_extend(0, memoryview(bytearray(inner))) == expected
    assert crc32c_extend(0, np.frombuffer(inner, dtype=np.uint8).copy()) == expected


def test_typed_and_multidimensional_buffers_are_read_as_their_bytes():
    values = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    assert crc32c_extend(0, memoryview(values)) == direct(values.tobytes())
    assert crc32c_extend(0, array.array("d", [1.5, -2.0])) == direct(
        array.array("d", [1.5, -2.0]).tobytes()
    )


def test_a_non_contiguous_buffer_is_refused_rather_than_checksummed_wrongly():
    values = np.arange(16, dtype=np.uint8).reshape(4, 4)[:, ::2]
    with pytest.raises(BufferError):
        crc32c_extend(0, memoryview(values))


def test_the_hardware_path_is_in_use_on_this_machine():
    # The CPU's CRC32C instruction is what makes verifying on load cheap; losing it silently
    # (a crc32c build without it) would make every save and load several times slower.
    assert checksum.NATIVE


def _longest_pause_of_another_thread(view: memoryview) -> tuple[float, float]:
    """How long one ``crc32c_extend`` over ``view`` took on a worker thread, and the longest
    the main thread, spinning meanwhile, went without running: about the call's whole length if
    the call held the GIL, a small part of it if it released it."""
    import sys
    import threading
    import time

    finished = threading.Event()
    took = [0.0]

    def one_call() -> None:
        began = time.perf_counter()
        crc32c_extend(0, view)
        took[0] = time.perf_counter() - began
        finished.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # hand the GIL over quickly, so only a held call shows a pause
    try:
        worker = threading.Thread(target=one_call)
        longest, last = 0.0, time.perf_counter()
        worker.start()
        while True:
            now = time.perf_counter()
            longest, last = max(longest, now - last), now
            if finished.is_set():
                break
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    return took[0], longest


def test_checksumming_releases_the_gil_so_threads_run_side_by_side():
    # A reader's threads checksum what they read at once; a call holding the GIL would make
    # them, and the training thread, take turns. The best of three tries keeps a moment of the
    # shared machine's scheduling out of it.
    data = np.random.default_rng(0).integers(0, 256, 256 << 20, dtype=np.uint8)
    tries = [_longest_pause_of_another_thread(memoryview(data)) for _ in range(3)]
    assert min(pause / took for took, pause in tries) < 0.5, tries


# -- encoded form ---------------------------------------------------------------------------------


@given(crcs)
def test_encoding_round_trips(value):
    text = encode_crc32c(value)
    assert len(text) == 8
    assert decode_crc32c(text) == value


@pytest.mark.parametrize(
    "text", ["", "AAAAAA=", "AAAAAAA=", "AAAAAAAA", "AAAAAB==", "AA AAA==", "AAAA\nA==", None, 7]
)
def test_anything_but_an_encoded_crc_is_refused(text):
    with pytest.raises(ValueError):
        decode_crc32c(text)


def test_the_encoding_is_base64_of_the_big_endian_value_as_object_stores_report_it():
    # 0xE3069283 is CRC32C's published check value, the CRC of b"123456789"
    assert crc32c_extend(0, b"123456789") == 0xE3069283
    assert crc32c_of(b"123456789") == "4waSgw=="


# -- the storage writer appends blocks by their known CRC -----------------------------------------


@pytest.mark.parametrize("name", backends_with(multipart_uploads=False))  # whole-file writers
def test_blocks_written_with_their_crc_give_the_manifest_the_crc_of_the_file(
    name, request, tmp_path
):
    from tests.conftest import make_backend

    rng = np.random.default_rng(0)
    # 40 MiB crosses several of the local writer's 16 MiB writeback pieces
    big = rng.integers(0, 256, size=40 << 20, dtype=np.uint8)
    small = b"between"
    floats = np.arange(1000, dtype=np.float32)
    with make_backend(name, request, tmp_path).open_store() as store:
        writer = store.run("r").begin(1)
        with writer.open("f.bin") as out:
            assert out.write(memoryview(big), crc=crc32c_extend(0, big)) == big.nbytes
            assert out.write(small) == len(small)
            assert out.write(memoryview(floats), crc=crc32c_extend(0, floats)) == floats.nbytes
            assert out.write(b"", crc=0) == 0
        writer.commit()
        whole = big.tobytes() + small + floats.tobytes()
        entry = store.run("r").read_manifest(1).file("f.bin")
        assert (entry.size, entry.crc32c) == (len(whole), crc32c_of(whole))
        assert store.run("r").reader(1).read_bytes("f.bin") == whole
