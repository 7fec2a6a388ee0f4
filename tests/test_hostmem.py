"""xpu.hostmem: the anonymous mappings behind pinned buffers, and their huge-page and fork advice."""
from __future__ import annotations

import io
import os

import pytest
import torch

from xpu import hostmem


@pytest.fixture
def advised(monkeypatch):
    calls = []
    monkeypatch.setattr(hostmem, "advise_huge_pages", lambda mapping: calls.append(len(mapping)) or True)
    return calls


def test_mappings_are_exact_and_advised_unless_turned_off(monkeypatch, advised):
    monkeypatch.delenv(hostmem.ENV, raising=False)
    assert len(hostmem.anonymous_mapping(3 * hostmem.HUGE_PAGE_BYTES + 5)) == 3 * hostmem.HUGE_PAGE_BYTES + 5
    assert advised == [3 * hostmem.HUGE_PAGE_BYTES + 5]  # default: huge pages
    monkeypatch.setenv(hostmem.ENV, "1")
    hostmem.anonymous_mapping(4 * hostmem.HUGE_PAGE_BYTES)
    hostmem.anonymous_mapping(4096)  # smaller than one huge page: nothing to advise
    assert advised == [3 * hostmem.HUGE_PAGE_BYTES + 5, 4 * hostmem.HUGE_PAGE_BYTES]
    monkeypatch.setenv(hostmem.ENV, "0")
    hostmem.anonymous_mapping(4 * hostmem.HUGE_PAGE_BYTES)
    assert advised == [3 * hostmem.HUGE_PAGE_BYTES + 5, 4 * hostmem.HUGE_PAGE_BYTES]


def test_a_bad_setting_or_size_says_what_would_work(monkeypatch):
    monkeypatch.setenv(hostmem.ENV, "yes")
    with pytest.raises(ValueError, match=r"XPU_HOST_HUGEPAGES must be 1 .* or 0 \(4 KiB pages\), got 'yes'"):
        hostmem.anonymous_mapping(hostmem.HUGE_PAGE_BYTES)
    monkeypatch.delenv(hostmem.ENV)
    with pytest.raises(ValueError, match="positive size"):
        hostmem.anonymous_mapping(0)


def test_the_real_advice_never_raises():
    mapping = hostmem.anonymous_mapping(2 * hostmem.HUGE_PAGE_BYTES)
    assert hostmem.advise_huge_pages(mapping) in (True, False)  # False where the kernel has no THP
    mapping[0:4] = b"abcd"  # still ordinary memory
    assert mapping[0:4] == b"abcd"


def smaps_at(address: int) -> tuple[str, set[str]]:
    """The sharing, 'p' (private) or 's' (shared), and the VmFlags of the mapping holding
    ``address``, from /proc/self/smaps."""
    sharing = None
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            lo, hi = (int(a, 16) for a in head[0].split("-"))
            sharing = head[1][3] if lo <= address < hi else None
        elif sharing and head[0] == "VmFlags:":
            return sharing, set(head[1:])
    raise AssertionError("mapping not found in /proc/self/smaps")


def mapped_in_child(address: int) -> bool:
    """Whether a forked child has ``address`` mapped (its /proc/self/maps)."""
    pid = os.fork()
    if pid == 0:  # the child: answer by the exit status, nothing else
        found = any(int(lo, 16) <= address < int(hi, 16)
                    for lo, hi in (line.split()[0].split("-") for line in open("/proc/self/maps")))
        os._exit(1 if found else 0)
    return os.waitpid(pid, 0)[1] != 0


def _smaps(mapping) -> tuple[str, set[str]]:
    import ctypes

    return smaps_at(ctypes.addressof(ctypes.c_char.from_buffer(mapping)))


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_huge_page_mappings_are_private_and_not_forked(monkeypatch):
    """Shared anonymous memory is shmem, which takes no transparent huge pages by default: the
    advice only works on a private mapping, and a private pinned mapping must not reach a forked
    child (VmFlags ``dc``: do not copy on fork)."""
    monkeypatch.delenv(hostmem.ENV, raising=False)
    sharing, flags = _smaps(hostmem.anonymous_mapping(2 * hostmem.HUGE_PAGE_BYTES))
    assert sharing == "p" and "dc" in flags
    sharing, flags = _smaps(hostmem.anonymous_mapping(4096))  # too small for a huge page: private all the same
    assert sharing == "p" and "dc" in flags
    import ctypes

    kept = hostmem.anonymous_mapping(2 * hostmem.HUGE_PAGE_BYTES)
    assert not mapped_in_child(ctypes.addressof(ctypes.c_char.from_buffer(kept)))
    monkeypatch.setenv(hostmem.ENV, "0")
    shared = hostmem.anonymous_mapping(2 * hostmem.HUGE_PAGE_BYTES)
    sharing, flags = _smaps(shared)
    assert sharing == "s" and "dc" not in flags  # the opt-out: as before session 38
    assert mapped_in_child(ctypes.addressof(ctypes.c_char.from_buffer(shared)))  # the check can tell


def resident_bytes(address: int, nbytes: int) -> int:
    """Bytes of ``[address, address + nbytes)`` whose pages are present in memory (the "present"
    bit of each 4 KiB page in /proc/self/pagemap, readable unprivileged)."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = address // page, (address + nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as fh:
        fh.seek(first * 8)
        entries = fh.read((last - first + 1) * 8)
    return page * sum(int.from_bytes(entries[k:k + 8], "little") >> 63 for k in range(0, len(entries), 8))


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="needs Linux /proc")
@pytest.mark.parametrize("huge", ["1", "0"])
def test_a_mapped_buffer_is_faulted_in_before_it_is_registered(monkeypatch, huge):
    """Registering faults every page on one thread; ``mapped_buffer`` has torch's pool fault them
    first, so every page is resident (and still zero) when the backend registers it."""
    import ctypes

    monkeypatch.setenv(hostmem.ENV, huge)
    nbytes = 3 * hostmem.HUGE_PAGE_BYTES + 4096
    fresh = hostmem.anonymous_mapping(nbytes)
    assert resident_bytes(ctypes.addressof(ctypes.c_char.from_buffer(fresh)), nbytes) == 0  # the check can tell
    mapping, buf = hostmem.mapped_buffer(nbytes)
    assert buf.numel() == nbytes and buf.dtype == torch.uint8
    assert buf.data_ptr() == ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    page = os.sysconf("SC_PAGE_SIZE")
    assert resident_bytes(buf.data_ptr(), nbytes) == -(-nbytes // page) * page
    assert not buf.any()  # read last: a read maps the shared zero page, which counts as present


def test_mem_available_reads_meminfo_in_bytes_and_none_without_the_field(monkeypatch):
    assert hostmem.mem_available() > 0  # Linux: CI and the device machines
    monkeypatch.setattr(hostmem, "open", lambda path: io.StringIO("MemTotal: 10 kB\nMemAvailable:   7 kB\n"), raising=False)
    assert hostmem.mem_available() == 7 * 1024
    monkeypatch.setattr(hostmem, "open", lambda path: io.StringIO("MemTotal: 10 kB\n"), raising=False)
    assert hostmem.mem_available() is None


def test_the_kernels_huge_page_mode_is_the_bracketed_word(monkeypatch):
    for text, mode in (("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
                       ("always madvise [never]\n", "never"), ("garbled\n", None)):
        monkeypatch.setattr(hostmem, "open", lambda path, text=text: io.StringIO(text), raising=False)
        assert hostmem.transparent_huge_pages() == mode

    def missing(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(hostmem, "open", missing, raising=False)
    assert hostmem.transparent_huge_pages() is None
