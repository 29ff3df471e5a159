#!/usr/bin/env python3
"""The least a packet of an established flow can cost on this kernel, as a yardstick for kpr's.

A hand-assembled tc program does only the work no conntrack-hit path can skip: it reads the
IPv4/TCP headers, looks the 16-byte 5-tuple up in an LRU hash map of kpr's size, applies a
checksum difference precomputed per entry with one `bpf_l4_csum_replace` (pseudo header),
writes the addresses, ports, TTL and IP checksum in place and calls `bpf_redirect_neigh`.
It keeps no state, counts nothing and handles nothing else (no IPv6, no options, no partial
checksum detection), so it is a lower bound, not a design. A second program is the same without
the checksum call. Each is measured as kpr-bench measures kpr's program: BPF_PROG_TEST_RUN with
the kernel's `repeat` (200 runs per call, the packet going to the backend and back), in rounds
alternating with its own floor (a non-IP frame, which returns at the first check).

Run as root: `python3 tests/bench/least_hit.py [ROUNDS]`. Prints ns above the floor and writes
`target/bench/least_hit.json`. Nothing is attached: the programs only ever run under TestRun.
"""
import ctypes
import json
import os
import socket
import statistics
import struct
import sys

BPF_MAP_CREATE, BPF_MAP_UPDATE_ELEM, BPF_PROG_LOAD, BPF_PROG_TEST_RUN = 0, 2, 5, 10
BPF_MAP_TYPE_LRU_HASH, BPF_PROG_TYPE_SCHED_CLS = 9, 3
MAX_CONNTRACK, CT_VALUE_SIZE = 262_144, 80  # kpr's table size and entry size
HELPER_MAP_LOOKUP, HELPER_L4_CSUM_REPLACE, HELPER_REDIRECT_NEIGH = 1, 11, 152
BPF_F_PSEUDO_HDR, TC_ACT_UNSPEC, TC_ACT_REDIRECT = 0x10, 0xFFFFFFFF, 7
SKB_DATA, SKB_DATA_END = 76, 80  # offsets in struct __sk_buff
CHUNK, CHUNKS_PER_ROUND = 200, 100

libc = ctypes.CDLL(None, use_errno=True)


def bpf(cmd, attr):
    buf = ctypes.create_string_buffer(attr, 160)
    fd = libc.syscall(321, cmd, buf, 160)  # __NR_bpf on x86-64
    if fd < 0:
        raise OSError(ctypes.get_errno(), f"bpf({cmd})")
    return fd, buf.raw


def ones_sum(data):
    """The one's complement sum of `data` as native (little-endian) 16-bit words, folded."""
    s = sum(struct.unpack(f"<{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return s


def diff(old, new):
    """The one's complement difference of `old` becoming `new` (as `bpf_csum_diff` gives it)."""
    return ones_sum(new + bytes(b ^ 0xFF for b in old))


def key(src, dst, sport, dport):
    return socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack(">HH", sport, dport) + bytes([6, 0, 0, 0])


def entry(old_key, src, dst, sport, dport):
    """New addresses and ports, the L4 checksum's difference (pseudo header and ports), the IP
    checksum's (addresses and the TTL one down), the link and next hop of the redirect."""
    addrs, ports = socket.inet_aton(src) + socket.inet_aton(dst), struct.pack(">HH", sport, dport)
    l4 = diff(old_key[:12], addrs + ports)
    ip = ones_sum(struct.pack("<HH", diff(old_key[:8], addrs), 0xFFFE))  # TTL: its word one down
    value = addrs + ports + struct.pack("<IIII", l4, ip, 1, 0x0100000A)
    return value + bytes(CT_VALUE_SIZE - len(value))


class Asm:
    """BPF instructions with forward jumps to one label, `out` (the packet is not ours)."""

    def __init__(self):
        self.insns = []

    def __call__(self, code, dst=0, src=0, off=0, imm=0):
        self.insns.append((code, dst, src, off, imm))

    def assemble(self):
        out_at = len(self.insns)
        self(0xB7, 0, imm=-1)  # r0 = TC_ACT_UNSPEC
        self(0x95)
        return b"".join(
            struct.pack("<BBhi", c, d | s << 4, out_at - i - 1 if o == "out" else o, m)
            for i, (c, d, s, o, m) in enumerate(self.insns)
        )


def program(map_fd, with_csum_helper):
    a = Asm()
    a(0xBF, 6, 1)  # r6 = skb
    a(0x61, 2, 6, SKB_DATA), a(0x61, 3, 6, SKB_DATA_END)
    a(0xBF, 4, 2), a(0x07, 4, imm=54), a(0x2D, 4, 3, off="out")  # Ethernet + IPv4 + TCP
    a(0x69, 4, 2, 12), a(0x55, 4, off="out", imm=0x0008)  # IPv4
    a(0x71, 4, 2, 14), a(0x55, 4, off="out", imm=0x45)  # no options
    a(0x71, 4, 2, 23), a(0x55, 4, off="out", imm=6)  # TCP
    for at, slot in ((26, -16), (30, -12), (34, -8)):  # addresses, ports: the key on the stack
        a(0x61, 4, 2, at), a(0x63, 10, 4, slot)
    a(0x62, 10, 0, -4, 6)
    a(0x18, 1, 1, 0, map_fd), a(0)  # r1 = the map
    a(0xBF, 2, 10), a(0x07, 2, imm=-16)
    a(0x85, imm=HELPER_MAP_LOOKUP)
    a(0x15, 0, off="out", imm=0)
    a(0xBF, 7, 0)  # r7 = the entry
    if with_csum_helper:
        a(0xBF, 1, 6), a(0xB7, 2, imm=50), a(0xB7, 3, imm=0), a(0x61, 4, 7, 12), a(0xB7, 5, imm=BPF_F_PSEUDO_HDR)
        a(0x85, imm=HELPER_L4_CSUM_REPLACE)
        a(0x55, 0, off="out", imm=0)
    a(0x61, 2, 6, SKB_DATA), a(0x61, 3, 6, SKB_DATA_END)  # calls end the packet pointers
    a(0xBF, 4, 2), a(0x07, 4, imm=54), a(0x2D, 4, 3, off="out")
    a(0x71, 5, 2, 22), a(0xA5, 5, off="out", imm=2)  # TTL below 2: the stack's
    a(0x07, 5, imm=-1), a(0x73, 2, 5, 22)
    for at, field in ((26, 0), (30, 4), (34, 8)):
        a(0x61, 4, 7, field), a(0x63, 2, 4, at)
    # IP checksum: ~(~check + diff), folded.
    a(0x69, 4, 2, 24), a(0xA7, 4, imm=0xFFFF), a(0x61, 5, 7, 16), a(0x0F, 4, 5)
    a(0xBF, 5, 4), a(0x77, 5, imm=16), a(0x57, 4, imm=0xFFFF), a(0x0F, 4, 5)
    a(0xBF, 5, 4), a(0x77, 5, imm=16), a(0x0F, 4, 5), a(0xA7, 4, imm=0xFFFF)
    a(0x6B, 2, 4, 24)
    # bpf_redirect_neigh(link, &{AF_INET, next hop}, 20, 0)
    a(0x62, 10, 0, -40, socket.AF_INET), a(0x61, 4, 7, 24), a(0x63, 10, 4, -36)
    a(0x7A, 10, 0, -32, 0), a(0x62, 10, 0, -24, 0)
    a(0x61, 1, 7, 20), a(0xBF, 2, 10), a(0x07, 2, imm=-40), a(0xB7, 3, imm=20), a(0xB7, 4, imm=0)
    a(0x85, imm=HELPER_REDIRECT_NEIGH)
    a(0x95)
    code, lic = ctypes.create_string_buffer(a.assemble()), ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(1 << 16)
    attr = struct.pack(
        "<IIQQIIQII16s", BPF_PROG_TYPE_SCHED_CLS, len(code.raw) // 8, ctypes.addressof(code),
        ctypes.addressof(lic), 1, len(log), ctypes.addressof(log), 0, 0, b"least_hit",
    )
    try:
        return bpf(BPF_PROG_LOAD, attr)[0]
    except OSError:
        sys.exit(f"the verifier refused the program:\n{log.value.decode()}")


def frame(src, dst, sport, dport, eth_type=0x0800):
    ip = struct.pack(">BBHHHBBH4s4s", 0x45, 0, 40, 0, 0, 255, 6, 0, socket.inet_aton(src), socket.inet_aton(dst))
    ip = ip[:10] + struct.pack("<H", 0xFFFF ^ ones_sum(ip)) + ip[12:]
    tcp = struct.pack(">HHIIBBHHH", sport, dport, 1, 1, 0x50, 0x10, 65535, 0, 0)
    pseudo = ip[12:20] + struct.pack(">BBH", 0, 6, len(tcp))
    tcp = tcp[:16] + struct.pack("<H", 0xFFFF ^ ones_sum(pseudo + tcp)) + tcp[18:]
    return b"\x02" * 6 + b"\x04" * 6 + struct.pack(">H", eth_type) + ip + tcp


def test_run(prog_fd, data, repeat):
    """(the verdict, the mean ns of one run, the packet the last run left)"""
    inp, out = ctypes.create_string_buffer(data), ctypes.create_string_buffer(256)
    attr = struct.pack("<IIIIQQII", prog_fd, 0, len(data), 256, ctypes.addressof(inp), ctypes.addressof(out), repeat, 0)
    _, raw = bpf(BPF_PROG_TEST_RUN, attr)
    verdict, ns = struct.unpack_from("<I", raw, 4)[0], struct.unpack_from("<I", raw, 36)[0]
    return verdict, ns, out.raw[: len(data)]


def check_translation(prog_fd, packet, with_csum_helper):
    verdict, _, out = test_run(prog_fd, packet, 1)
    assert verdict == TC_ACT_REDIRECT, f"verdict {verdict}"
    assert out[30:34] == socket.inet_aton("10.244.1.2") and out[36:38] == struct.pack(">H", 8080), out.hex()
    assert out[22] == 254 and ones_sum(out[14:34]) == 0xFFFF, "the IP header does not verify"
    if with_csum_helper:
        pseudo = out[26:34] + struct.pack(">BBH", 0, 6, 20)
        assert ones_sum(pseudo + out[34:54]) == 0xFFFF, "the TCP checksum does not verify"
    _, _, back = test_run(prog_fd, packet, 2)
    assert back[30:34] == socket.inet_aton("10.96.0.10") and back[36:38] == struct.pack(">H", 80), back.hex()


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    key_size = 16
    map_fd, _ = bpf(BPF_MAP_CREATE, struct.pack("<IIIII", BPF_MAP_TYPE_LRU_HASH, key_size, CT_VALUE_SIZE, MAX_CONNTRACK, 0))
    # The flow both ways, as kpr-bench's: each run takes the packet to the backend, the next back.
    to_service, to_backend = key("10.0.0.99", "10.96.0.10", 40000, 80), key("10.0.0.99", "10.244.1.2", 40000, 8080)
    for k, v in (
        (to_service, entry(to_service, "10.0.0.99", "10.244.1.2", 40000, 8080)),
        (to_backend, entry(to_backend, "10.0.0.99", "10.96.0.10", 40000, 80)),
    ):
        kb, vb = ctypes.create_string_buffer(k), ctypes.create_string_buffer(v)
        bpf(BPF_MAP_UPDATE_ELEM, struct.pack("<IIQQQ", map_fd, 0, ctypes.addressof(kb), ctypes.addressof(vb), 0))
    packet, floor = frame("10.0.0.99", "10.96.0.10", 40000, 80), frame("0.0.0.0", "0.0.0.0", 0, 0, 0x0806)
    results = {}
    programs = {"whole": program(map_fd, True), "without_csum_helper": program(map_fd, False)}
    over = {label: [] for label in programs}
    for label, fd in programs.items():
        check_translation(fd, packet, label == "whole")
        assert test_run(fd, floor, 1)[0] == TC_ACT_UNSPEC
    for _ in range(rounds):
        for label, fd in programs.items():
            hit = statistics.fmean(test_run(fd, packet, CHUNK)[1] for _ in range(CHUNKS_PER_ROUND))
            base = statistics.fmean(test_run(fd, floor, CHUNK)[1] for _ in range(CHUNKS_PER_ROUND))
            over[label].append(hit - base)
    for label, values in over.items():
        values.sort()
        results[label] = {"median": statistics.median(values), "p20": values[len(values) // 5], "min": values[0]}
        print(f"least hit path, {label}: {results[label]['median']:.1f} ns above its floor "
              f"(p20 {results[label]['p20']:.1f}, min {results[label]['min']:.1f}; {rounds} rounds)")
    os.makedirs("target/bench", exist_ok=True)
    with open("target/bench/least_hit.json", "w") as f:
        json.dump({"rounds": rounds, "runs_per_round": CHUNK * CHUNKS_PER_ROUND, "above_floor": results}, f, indent=1)


if __name__ == "__main__":
    main()
