//! The tc programs on crafted packets through BPF_PROG_TEST_RUN: input packet + map state →
//! verdict and output bytes, checksums included (expected packets are built from scratch with
//! freshly computed checksums, never by patching the input). Needs root.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::PathBuf,
    sync::{Mutex, Once, PoisonError},
};

use aya::{
    Ebpf,
    programs::{SchedClassifier, TestRun as _, TestRunOptions},
};
use kpr::{
    datapath::{
        Capacity, Maps as _, Programmer,
        backend_answers::BackendWatch,
        bpf::{self, BpfMaps, DatapathConfig},
        conntrack::{Conntrack, Sweep, monotonic_now},
    },
    model::{
        ObjectKey, Protocol, ServicePortName,
        cidr::Cidr,
        desired::{Desired, DesiredPort, frontend_key},
        outliers::{Answers, Endpoint},
    },
};
use kpr_tests::map_state::MapState;
use proxy_common::{
    Addr, CidrKey, CtKey, CtKey4, CtTimeouts, CtValue, DETECT_LOCAL_CIDR, LINK_FLAG_TC_INGRESS, LinkInfo,
    NODE_ADDR_LOCAL, NODE_ADDR_NODEPORT, SCOPE_EXTERNAL, SCOPE_NODE, SCOPE_POD, SERVICE_FLAG_DROP_NO_ENDPOINTS,
    SERVICE_FLAG_DSR, SERVICE_FLAG_MAGLEV, SERVICE_FLAG_SNAT, SERVICE_FLAG_SOURCE_RANGES, SNAT_PORT_MIN, TCP_ACK,
    TCP_FIN, TCP_PSH, TCP_RST, TCP_SYN, counter, ct, event, map_names, program_names, service_stat, tc_slow_path,
};

const TC_ACT_OK: u32 = 0;
/// -1: "not mine", the next program or filter of the hook decides.
const TC_ACT_UNSPEC: u32 = u32::MAX;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;
const NODE_IP: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 99);
const POD: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 2);
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const NODE_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1);
const CLIENT6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x99);
const POD6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 2, 0, 0, 0, 2);
const CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x10);
/// No backends.
const NONE: &[(Ipv4Addr, u16)] = &[];

// ---------- packet building, with checksums computed from scratch ----------

fn csum(data: &[u8], initial: u32) -> u16 {
    let mut sum = initial;
    for chunk in data.chunks(2) {
        let word =
            if chunk.len() == 2 { u16::from_be_bytes([chunk[0], chunk[1]]) } else { u16::from_be_bytes([chunk[0], 0]) };
        sum += u32::from(word);
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// The TCP/UDP (ICMPv6) checksum of `l4` (its checksum field zero) with the pseudo-header of
/// the addresses' family.
fn l4_csum(src: IpAddr, dst: IpAddr, proto: u8, l4: &[u8]) -> u16 {
    let mut pseudo = Vec::new();
    match (src, dst) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => {
            pseudo.extend_from_slice(&src.octets());
            pseudo.extend_from_slice(&dst.octets());
            pseudo.extend_from_slice(&[0, proto]);
            pseudo.extend_from_slice(&(l4.len() as u16).to_be_bytes());
        }
        (IpAddr::V6(src), IpAddr::V6(dst)) => {
            pseudo.extend_from_slice(&src.octets());
            pseudo.extend_from_slice(&dst.octets());
            pseudo.extend_from_slice(&(l4.len() as u32).to_be_bytes());
            pseudo.extend_from_slice(&[0, 0, 0, proto]);
        }
        _ => panic!("addresses of two families"),
    }
    pseudo.extend_from_slice(l4);
    csum(&pseudo, 0)
}

#[derive(Clone, Copy)]
struct Pkt {
    src: IpAddr,
    dst: IpAddr,
    sport: u16,
    dport: u16,
    proto: u8,
    tcp_flags: u8,
    seq: u32,
    ack: u32,
    /// UDP: send a zero (absent) checksum; SCTP: a zero checksum, left to the device.
    zero_csum: bool,
    frag: u16,
    /// SCTP: the type of the packet's one chunk.
    chunk: u8,
}

fn tcp(src: impl Into<IpAddr>, sport: u16, dst: impl Into<IpAddr>, dport: u16) -> Pkt {
    Pkt {
        src: src.into(),
        dst: dst.into(),
        sport,
        dport,
        proto: 6,
        tcp_flags: TCP_SYN,
        seq: 1000,
        ack: 0,
        zero_csum: false,
        frag: 0,
        chunk: 0,
    }
}

/// An SCTP packet with one INIT chunk (type 1).
fn sctp(src: impl Into<IpAddr>, sport: u16, dst: impl Into<IpAddr>, dport: u16) -> Pkt {
    Pkt { proto: 132, tcp_flags: 0, chunk: 1, ..tcp(src, sport, dst, dport) }
}

/// CRC32c as RFC 9260 appendix A computes it, bit by bit (independent of kpr's code).
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0x82f6_3b78 } else { crc >> 1 };
        }
    }
    !crc
}

/// The SCTP checksum of an IPv4 frame is right: the CRC32c of the SCTP packet with its
/// checksum field zero, stored little-endian.
fn sctp_crc_ok(frame: &[u8]) -> bool {
    let mut sctp = frame[34..].to_vec();
    let stored = u32::from_le_bytes(sctp[8..12].try_into().unwrap());
    sctp[8..12].fill(0);
    stored == crc32c(&sctp)
}

fn udp(src: impl Into<IpAddr>, sport: u16, dst: impl Into<IpAddr>, dport: u16) -> Pkt {
    Pkt { proto: 17, tcp_flags: 0, ..tcp(src, sport, dst, dport) }
}

impl Pkt {
    fn payload(&self) -> &'static [u8] {
        if self.tcp_flags & TCP_RST != 0 { b"" } else { b"hello" }
    }

    fn bytes(&self) -> Vec<u8> {
        self.bytes_with_macs([0xaa; 6], [0xbb; 6])
    }

    fn bytes_with_macs(&self, dst_mac: [u8; 6], src_mac: [u8; 6]) -> Vec<u8> {
        let payload = self.payload();
        let mut l4 = Vec::new();
        l4.extend_from_slice(&self.sport.to_be_bytes());
        l4.extend_from_slice(&self.dport.to_be_bytes());
        if self.proto == 132 {
            // Verification tag, checksum (below), one chunk: type, flags, length, value, padding.
            l4.extend_from_slice(&[0xc0, 0xff, 0xee, 0x01, 0, 0, 0, 0]);
            l4.extend_from_slice(&[self.chunk, 0]);
            l4.extend_from_slice(&((4 + payload.len()) as u16).to_be_bytes());
            l4.extend_from_slice(payload);
            l4.resize(l4.len().next_multiple_of(4), 0);
            if !self.zero_csum {
                let c = crc32c(&l4);
                l4[8..12].copy_from_slice(&c.to_le_bytes());
            }
            return self.frame((dst_mac, src_mac), 0x1234, self.frag, &l4);
        }
        if self.proto == 6 {
            l4.extend_from_slice(&self.seq.to_be_bytes());
            l4.extend_from_slice(&self.ack.to_be_bytes());
            l4.extend_from_slice(&[5 << 4, self.tcp_flags]);
            l4.extend_from_slice(&(if self.tcp_flags & TCP_RST != 0 { 0u16 } else { 64240u16 }).to_be_bytes());
            l4.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent pointer
        } else {
            l4.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
            l4.extend_from_slice(&[0, 0]);
        }
        l4.extend_from_slice(payload);
        let c = l4_csum(self.src, self.dst, self.proto, &l4);
        let csum_off = if self.proto == 6 { 16 } else { 6 };
        if !(self.proto == 17 && self.zero_csum) {
            let c = if self.proto == 17 && c == 0 { 0xffff } else { c };
            l4[csum_off..csum_off + 2].copy_from_slice(&c.to_be_bytes());
        }
        // A reset is sent as the kernel sends one: id 0, don't fragment.
        let (id, frags) = if self.tcp_flags & TCP_RST != 0 { (0, 0x4000) } else { (0x1234, self.frag) };
        self.frame((dst_mac, src_mac), id, frags, &l4)
    }

    /// The frame of this packet's family around `l4`.
    fn frame(&self, macs: ([u8; 6], [u8; 6]), id: u16, frags: u16, l4: &[u8]) -> Vec<u8> {
        match (self.src, self.dst) {
            (IpAddr::V4(src), IpAddr::V4(dst)) => {
                frame(macs, Ip { src, dst, proto: self.proto, tos: 0, id, frags }, l4)
            }
            (IpAddr::V6(src), IpAddr::V6(dst)) => frame6(macs, src, dst, self.proto, l4),
            _ => panic!("addresses of two families"),
        }
    }
}

/// IPv4 header fields a test packet varies.
struct Ip {
    src: Ipv4Addr,
    dst: Ipv4Addr,
    proto: u8,
    tos: u8,
    id: u16,
    frags: u16,
}

/// An Ethernet frame (`macs`: destination, source) carrying an IPv4 packet with header `ip`
/// (checksum computed from scratch) and `payload`.
fn frame(macs: ([u8; 6], [u8; 6]), ip: Ip, payload: &[u8]) -> Vec<u8> {
    let mut header = vec![0x45, ip.tos];
    header.extend_from_slice(&((20 + payload.len()) as u16).to_be_bytes());
    header.extend_from_slice(&ip.id.to_be_bytes());
    header.extend_from_slice(&ip.frags.to_be_bytes());
    header.extend_from_slice(&[64, ip.proto, 0, 0]);
    header.extend_from_slice(&ip.src.octets());
    header.extend_from_slice(&ip.dst.octets());
    let c = csum(&header, 0);
    header[10..12].copy_from_slice(&c.to_be_bytes());
    let mut out = Vec::new();
    out.extend_from_slice(&macs.0);
    out.extend_from_slice(&macs.1);
    out.extend_from_slice(&[0x08, 0x00]);
    out.extend_from_slice(&header);
    out.extend_from_slice(payload);
    out
}

/// An Ethernet frame carrying an IPv6 packet (hop limit 64, no extension header).
fn frame6(macs: ([u8; 6], [u8; 6]), src: Ipv6Addr, dst: Ipv6Addr, next_header: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&macs.0);
    out.extend_from_slice(&macs.1);
    out.extend_from_slice(&[0x86, 0xdd, 0x60, 0, 0, 0]);
    out.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    out.extend_from_slice(&[next_header, 64]);
    out.extend_from_slice(&src.octets());
    out.extend_from_slice(&dst.octets());
    out.extend_from_slice(payload);
    out
}

const MACS: ([u8; 6], [u8; 6]) = ([0xaa; 6], [0xbb; 6]);

/// Where the L4 header of a frame starts (IPv4 without options, or IPv6).
fn l4_offset(packet: &[u8]) -> usize {
    if packet[12..14] == [0x86, 0xdd] { 54 } else { 34 }
}

fn sport_of(packet: &[u8]) -> u16 {
    let at = l4_offset(packet);
    u16::from_be_bytes([packet[at], packet[at + 1]])
}

// ---------- the program under test ----------

/// A load of the object: its programs, its maps and their pins (removed on drop, also when
/// setting it up fails), and the maps as the load left them.
struct Load {
    /// The datapath settings it was loaded with (less the pin root).
    settings: String,
    ebpf: Ebpf,
    maps: BpfMaps,
    pins: testbed::PinRoot,
    fresh: MapState,
}

/// The loads no rig holds: a rig takes one of its settings and puts its maps back as they were
/// loaded, instead of loading anew (the verifier's 2 s here, tens of seconds in the VMs).
static IDLE_LOADS: Mutex<Vec<Load>> = Mutex::new(Vec::new());

/// At the process's exit, the idle loads' pins are removed.
extern "C" fn drop_idle_loads() {
    drop(std::mem::take(&mut *IDLE_LOADS.lock().unwrap_or_else(PoisonError::into_inner)));
}

/// The programs under test, on maps as fresh as a new load's, with a test's services.
struct Rig {
    load: Option<Load>,
    programmer: Programmer,
}

impl std::ops::Deref for Rig {
    type Target = Load;
    fn deref(&self) -> &Load {
        self.load.as_ref().expect("a rig holds its load until dropped")
    }
}

impl std::ops::DerefMut for Rig {
    fn deref_mut(&mut self) -> &mut Load {
        self.load.as_mut().expect("a rig holds its load until dropped")
    }
}

/// Idle loads kept, the most recently used: each holds about a hundred file descriptors.
const IDLE_LOADS_KEPT: usize = 4;

impl Drop for Rig {
    fn drop(&mut self) {
        if let Some(load) = self.load.take() {
            let mut idle = IDLE_LOADS.lock().unwrap_or_else(PoisonError::into_inner);
            idle.push(load);
            if idle.len() > IDLE_LOADS_KEPT {
                idle.remove(0);
            }
        }
    }
}

impl Load {
    /// An idle load of `cfg`'s settings with its maps put back, or a new one.
    fn of(cfg: &DatapathConfig) -> Self {
        static AT_EXIT: Once = Once::new();
        // SAFETY: registers a function without arguments that only drops Rust values.
        AT_EXIT.call_once(|| assert_eq!(unsafe { libc::atexit(drop_idle_loads) }, 0));
        let settings = format!("{:?}", DatapathConfig { pin_root: PathBuf::new(), ..cfg.clone() });
        let idle = {
            let mut idle = IDLE_LOADS.lock().unwrap_or_else(PoisonError::into_inner);
            idle.iter().position(|l| l.settings == settings).map(|i| idle.remove(i))
        };
        if let Some(mut load) = idle {
            load.fresh.restore().expect("the maps put back as loaded");
            bpf::fill_slow_path_slots(&mut load.ebpf).expect("the slow programs in their slots");
            load.maps = BpfMaps::open_pinned(&load.pins.0).expect("maps");
            load.maps.endpoint_counters = cfg.endpoint_counters;
            load.maps.maglev_seed = cfg.maglev_seed;
            load.maps.maglev_table_size = cfg.maglev_table_size;
            return load;
        }
        let pins = testbed::PinRoot::new("kt-tc");
        let cfg = DatapathConfig { pin_root: pins.0.clone(), ..cfg.clone() };
        let mut ebpf = bpf::open_object(&cfg).expect("load object");
        // Programs first: taking a map out of the object before loading breaks its relocation.
        bpf::load_tc_programs(&mut ebpf).expect("the verifier accepts the tc programs");
        if cfg.xdp != bpf::XdpSetting::Off {
            bpf::load_xdp_program(&mut ebpf).expect("the verifier accepts the XDP program");
        }
        let mut maps = BpfMaps::take_from(&mut ebpf).expect("maps");
        maps.endpoint_counters = cfg.endpoint_counters;
        maps.maglev_seed = cfg.maglev_seed;
        maps.maglev_table_size = cfg.maglev_table_size;
        let fresh = MapState::save(&bpf::pin_dir(&pins.0)).expect("the maps as loaded");
        Self { settings, ebpf, maps, pins, fresh }
    }
}

impl Rig {
    /// Load the object on fresh pins with `desired` programmed, NODE_IP as the node's address
    /// (NodePorts, masquerade) and 10.244.0.0/16 as the pods' range (local-traffic detector).
    fn new(desired: &Desired) -> Self {
        Self::with(desired, |_| {})
    }

    /// Like [`Rig::new`], with datapath settings changed by `tune`.
    fn with(desired: &Desired, tune: impl FnOnce(&mut DatapathConfig)) -> Self {
        let mut cfg = DatapathConfig::new(PathBuf::new(), "/nonexistent".into());
        cfg.detect_local = DETECT_LOCAL_CIDR;
        cfg.max_service_ports = 64;
        cfg.max_backends = 64;
        // Verdicts independent of this machine's routes, unless a test asks (in a namespace).
        cfg.forward_direct = bpf::ForwardDirect::Never;
        tune(&mut cfg);
        let mut load = Load::of(&cfg);
        // The node's address, written into the node maps below, gets its filter bit here.
        load.maps.mark_addresses([NODE_IP.into(), NODE_IP6.into()]).unwrap();
        let mut programmer = Programmer::recover(&mut load.maps).unwrap();
        assert_eq!(programmer.apply(desired, &mut load.maps).failed, 0);
        let ebpf = &mut load.ebpf;
        let mut node_addrs: aya::maps::HashMap<_, Addr, u32> =
            aya::maps::HashMap::try_from(ebpf.map_mut(proxy_common::map_names::NODE_ADDRS).unwrap()).unwrap();
        for node_ip in [IpAddr::from(NODE_IP), IpAddr::from(NODE_IP6)] {
            node_addrs.insert(&Addr::from(node_ip), &(NODE_ADDR_LOCAL | NODE_ADDR_NODEPORT), 0).unwrap();
        }
        // No link of its own: masquerade falls back to the primary address (ifindex 0).
        let mut links: aya::maps::HashMap<_, u32, LinkInfo> =
            aya::maps::HashMap::try_from(ebpf.map_mut(proxy_common::map_names::LINKS).unwrap()).unwrap();
        let fallback = LinkInfo { addr: u32::from(NODE_IP).to_be(), flags: 0, addr6: NODE_IP6.into() };
        links.insert(&0, &fallback, 0).unwrap();
        let mut cidrs: aya::maps::LpmTrie<_, CidrKey, u8> =
            aya::maps::LpmTrie::try_from(ebpf.map_mut(proxy_common::map_names::LOCAL_CIDRS).unwrap()).unwrap();
        let pods = CidrKey { addr: IpAddr::from(Ipv4Addr::new(10, 244, 0, 0)).into() };
        cidrs.insert(&aya::maps::lpm_trie::Key::new(Addr::V4_PREFIX_OFFSET + 16, pods), &1, 0).unwrap();
        let pods6 = CidrKey { addr: IpAddr::from(Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, 0)).into() };
        cidrs.insert(&aya::maps::lpm_trie::Key::new(48, pods6), &1, 0).unwrap();
        Self { load: Some(load), programmer }
    }

    fn run(&self, program: &str, input: &[u8]) -> (u32, Vec<u8>) {
        self.run_from(program, input, 0)
    }

    /// [`Rig::run`] for a packet that came in by link `ingress_ifindex` (0: the node's own).
    fn run_from(&self, program: &str, input: &[u8], ingress_ifindex: u32) -> (u32, Vec<u8>) {
        let prog: &SchedClassifier = self.ebpf.program(program).unwrap().try_into().unwrap();
        let mut out = vec![0u8; input.len().max(1500)];
        // `struct __sk_buff` up to `ingress_ifindex` (offset 36), the rest zero.
        let mut ctx = [0u8; 40];
        ctx[36..40].copy_from_slice(&ingress_ifindex.to_ne_bytes());
        let opts = TestRunOptions {
            data_in: Some(input),
            data_out: Some(&mut out),
            ctx_in: (ingress_ifindex != 0).then_some(&ctx[..]),
            ..TestRunOptions::default()
        };
        let result = prog.test_run(opts).expect("test run");
        out.truncate(result.data_size_out as usize);
        (result.return_value, out)
    }

    /// [`Rig::ingress`] for a probe of `kpr verify` (its mark in the test run's context).
    fn probe(&self, input: &[u8]) -> (u32, Vec<u8>) {
        let prog: &SchedClassifier = self.ebpf.program(program_names::TC_INGRESS).unwrap().try_into().unwrap();
        let mut out = vec![0u8; input.len().max(1500)];
        // `struct __sk_buff`: the mark at offset 8, the rest zero.
        let mut ctx = [0u8; 12];
        ctx[8..12].copy_from_slice(&proxy_common::VERIFY_PROBE_MARK.to_ne_bytes());
        let opts = TestRunOptions {
            data_in: Some(input),
            data_out: Some(&mut out),
            ctx_in: Some(&ctx[..]),
            ..TestRunOptions::default()
        };
        let result = prog.test_run(opts).expect("test run");
        out.truncate(result.data_size_out as usize);
        (result.return_value, out)
    }

    fn ingress(&self, input: &[u8]) -> (u32, Vec<u8>) {
        self.run(program_names::TC_INGRESS, input)
    }

    /// The XDP program on `input`, come in by link `ifindex` (of the calling thread's
    /// namespace): its action and the packet as it left.
    fn xdp(&self, input: &[u8], ifindex: u32) -> (u32, Vec<u8>) {
        let prog: &aya::programs::Xdp = self.ebpf.program(program_names::XDP).unwrap().try_into().unwrap();
        let mut out = vec![0u8; input.len().max(1500)];
        // `struct xdp_md`: data 0 (no metadata), data_end the packet's length, data_meta 0,
        // ingress_ifindex, rx_queue_index 0, egress_ifindex 0.
        let mut ctx = [0u8; 24];
        ctx[4..8].copy_from_slice(&(input.len() as u32).to_ne_bytes());
        ctx[12..16].copy_from_slice(&ifindex.to_ne_bytes());
        let opts = TestRunOptions {
            data_in: Some(input),
            data_out: Some(&mut out),
            ctx_in: Some(&ctx[..]),
            ..TestRunOptions::default()
        };
        let result = prog.test_run(opts).expect("XDP test run");
        out.truncate(result.data_size_out as usize);
        (result.return_value, out)
    }

    fn egress(&self, input: &[u8]) -> (u32, Vec<u8>) {
        self.run(program_names::TC_EGRESS, input)
    }

    fn reprogram(&mut self, desired: &Desired) {
        let load = self.load.as_mut().expect("a rig holds its load until dropped");
        assert_eq!(self.programmer.apply(desired, &mut load.maps).failed, 0);
    }

    fn counter(&self, index: u32) -> u64 {
        bpf::read_counters(&self.pins.0).unwrap()[index as usize].1
    }

    /// Word `index` of the pinned array map `name`.
    fn array_word(&self, name: &str, index: u32) -> u64 {
        let map = bpf::open_pinned_map(&self.pins.0, name).unwrap();
        aya::maps::Array::<_, u64>::try_from(aya::maps::Map::Array(map)).unwrap().get(&index, 0).unwrap()
    }

    fn conntrack(&self) -> Conntrack {
        Conntrack::open(&self.pins.0).unwrap()
    }

    /// An IPv4 conntrack table: established (`KPR_CONNTRACK4`) or new (`KPR_CT_NEW4`) flows.
    fn table4(&self, name: &str) -> aya::maps::HashMap<aya::maps::MapData, CtKey4, CtValue> {
        let map = aya::maps::MapData::from_pin(bpf::pin_dir(&self.pins.0).join(name)).unwrap();
        let map =
            if name == map_names::CT_NEW4 { aya::maps::Map::LruHashMap(map) } else { aya::maps::Map::HashMap(map) };
        aya::maps::HashMap::try_from(map).unwrap()
    }

    /// Conntrack entries of all tables, as (key, value) pairs (keys of either family).
    fn flows(&self) -> Vec<(CtKey, CtValue)> {
        self.conntrack().entries().into_iter().map(|(_, key, value)| (key, value)).collect()
    }

    /// Remove conntrack entries (an LRU eviction, as the programs would meet it).
    fn evict(&self, which: impl Fn(&CtKey, &CtValue) -> bool) -> usize {
        self.conntrack().remove_where(which).unwrap().1
    }
}

fn entry<A: Into<IpAddr> + Copy>(
    desired: &mut Desired,
    ip: impl Into<IpAddr>,
    port: u16,
    protocol: Protocol,
    scope: u8,
    backends: &[(A, u16)],
    flags: u32,
) {
    let ip = ip.into();
    let name = ServicePortName { service: ObjectKey::new("t", format!("{ip}:{port}")), port: String::new(), protocol };
    desired.insert(
        frontend_key(ip, port, protocol, scope),
        DesiredPort {
            name,
            backends: backends.iter().map(|(ip, port)| ((*ip).into(), *port)).collect(),
            flags,
            source_ranges: vec![],
            affinity_timeout: 0,
            serving: vec![],
            alive: None,
            remote: Vec::new(),
        },
    );
}

const LB_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);

/// A ClusterIP entry for pods and for outside clients alike.
fn cluster_ip(desired: &mut Desired, port: u16, protocol: Protocol, backends: &[(Ipv4Addr, u16)]) {
    for scope in [SCOPE_POD, SCOPE_EXTERNAL] {
        entry(desired, CLUSTER_IP, port, protocol, scope, backends, 0);
    }
}

fn services() -> Desired {
    let mut d = Desired::new();
    cluster_ip(&mut d, 80, Protocol::Tcp, &[(POD, 8080)]);
    cluster_ip(&mut d, 53, Protocol::Udp, &[(POD, 5353)]);
    cluster_ip(&mut d, 81, Protocol::Tcp, &[]);
    cluster_ip(&mut d, 54, Protocol::Udp, &[]);
    // SCTP (Diameter's port), with a targetPort of another number; one without endpoints.
    cluster_ip(&mut d, 3868, Protocol::Sctp, &[(POD, 3869)]);
    cluster_ip(&mut d, 3870, Protocol::Sctp, &[]);
    entry(&mut d, Ipv4Addr::UNSPECIFIED, 30868, Protocol::Sctp, SCOPE_EXTERNAL, &[(POD, 3869)], SERVICE_FLAG_SNAT);
    // NodePort 30080: eTP=Cluster (masquerade); 30081: eTP=Local without local endpoints.
    entry(&mut d, Ipv4Addr::UNSPECIFIED, 30080, Protocol::Tcp, SCOPE_EXTERNAL, &[(POD, 8080)], SERVICE_FLAG_SNAT);
    entry(&mut d, Ipv4Addr::UNSPECIFIED, 30081, Protocol::Tcp, SCOPE_EXTERNAL, NONE, SERVICE_FLAG_DROP_NO_ENDPOINTS);
    // An externalIP with eTP=Local and a local endpoint: no masquerade.
    entry(
        &mut d,
        Ipv4Addr::new(192, 0, 2, 7),
        443,
        Protocol::Tcp,
        SCOPE_EXTERNAL,
        &[(POD, 8443)],
        SERVICE_FLAG_DROP_NO_ENDPOINTS,
    );
    // A LoadBalancer IP open to 10.0.0.96/30 (which holds CLIENT, .99) only.
    entry(
        &mut d,
        LB_IP,
        80,
        Protocol::Tcp,
        SCOPE_EXTERNAL,
        &[(POD, 8080)],
        SERVICE_FLAG_SNAT | SERVICE_FLAG_SOURCE_RANGES,
    );
    d.get_mut(&frontend_key(LB_IP, 80, Protocol::Tcp, SCOPE_EXTERNAL)).unwrap().source_ranges =
        vec!["10.0.0.96/30".parse().unwrap()];
    // An externalIP with eTP=Local and no local endpoint; from inside, every endpoint.
    entry(&mut d, EXT_LOCAL, 443, Protocol::Tcp, SCOPE_EXTERNAL, NONE, SERVICE_FLAG_DROP_NO_ENDPOINTS);
    entry(&mut d, EXT_LOCAL, 443, Protocol::Tcp, SCOPE_POD, &[(REMOTE_POD, 8443)], 0);
    // NodePort 30082 from the node itself (its own address as source): every endpoint,
    // masqueraded; from outside it drops (eTP=Local, no local endpoint).
    entry(&mut d, Ipv4Addr::UNSPECIFIED, 30082, Protocol::Tcp, SCOPE_EXTERNAL, NONE, SERVICE_FLAG_DROP_NO_ENDPOINTS);
    entry(&mut d, Ipv4Addr::UNSPECIFIED, 30082, Protocol::Tcp, SCOPE_NODE, &[(REMOTE_POD, 8080)], SERVICE_FLAG_SNAT);
    // IPv6: a ClusterIP with endpoints (TCP, UDP) and without, and a NodePort (eTP=Cluster).
    for scope in [SCOPE_POD, SCOPE_EXTERNAL] {
        entry(&mut d, CLUSTER_IP6, 80, Protocol::Tcp, scope, &[(POD6, 8080)], 0);
        entry(&mut d, CLUSTER_IP6, 53, Protocol::Udp, scope, &[(POD6, 5353)], 0);
        entry(&mut d, CLUSTER_IP6, 81, Protocol::Tcp, scope, NONE, 0);
        entry(&mut d, CLUSTER_IP6, 54, Protocol::Udp, scope, NONE, 0);
    }
    entry(&mut d, Ipv6Addr::UNSPECIFIED, 30080, Protocol::Tcp, SCOPE_EXTERNAL, &[(POD6, 8080)], SERVICE_FLAG_SNAT);
    // IPv6: a NodePort with eTP=Local and no local endpoint; a LoadBalancer IP open to
    // fd00::98/126 (which holds CLIENT6, ::99) only.
    entry(&mut d, Ipv6Addr::UNSPECIFIED, 30085, Protocol::Tcp, SCOPE_EXTERNAL, NONE, SERVICE_FLAG_DROP_NO_ENDPOINTS);
    let flags = SERVICE_FLAG_SNAT | SERVICE_FLAG_SOURCE_RANGES;
    entry(&mut d, LB_IP6, 80, Protocol::Tcp, SCOPE_EXTERNAL, &[(POD6, 8080)], flags);
    d.get_mut(&frontend_key(LB_IP6, 80, Protocol::Tcp, SCOPE_EXTERNAL)).unwrap().source_ranges =
        vec!["fd00::98/126".parse().unwrap()];
    d
}

const LB_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1);

const EXT_LOCAL: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 8);
const REMOTE_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 3, 2);

#[test]
fn in_cluster_traffic_to_an_external_address_is_short_circuited_to_all_endpoints() {
    let rig = Rig::new(&services());
    let from_outside = tcp(CLIENT, 40030, EXT_LOCAL, 443);
    assert_eq!(rig.ingress(&from_outside.bytes()).0, TC_ACT_SHOT, "eTP=Local, no local endpoint: dropped");
    let from_pod = tcp(Ipv4Addr::new(10, 244, 1, 5), 40031, EXT_LOCAL, 443);
    let (verdict, out) = rig.ingress(&from_pod.bytes());
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        out,
        Pkt { dst: REMOTE_POD.into(), dport: 8443, ..from_pod }.bytes(),
        "a pod's traffic goes to any endpoint, unmasqueraded"
    );
}

#[test]
fn the_source_picks_the_entry_pod_outside_or_node() {
    let rig = Rig::new(&services());
    let from_outside = tcp(CLIENT, 40040, NODE_IP, 30082);
    assert_eq!(rig.ingress(&from_outside.bytes()).0, TC_ACT_SHOT, "from outside: eTP=Local without local endpoint");
    let from_node = tcp(NODE_IP, 40041, NODE_IP, 30082);
    let (verdict, out) = rig.ingress(&from_node.bytes());
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        out,
        Pkt { sport: sport_of(&out), dst: REMOTE_POD.into(), dport: 8080, ..from_node }.bytes(),
        "from the node: any endpoint, masqueraded"
    );
    assert_ne!(sport_of(&out), 40041, "masquerade gives the flow a port of its own");
    // A pod has no entry for this NodePort in this table: untouched.
    let from_pod = tcp(Ipv4Addr::new(10, 244, 1, 5), 40042, NODE_IP, 30082);
    assert_eq!(rig.ingress(&from_pod.bytes()), (TC_ACT_UNSPEC, from_pod.bytes()));
    // Not a NodePort address: untouched as well.
    let elsewhere = tcp(CLIENT, 40043, Ipv4Addr::new(10, 0, 0, 2), 30082);
    assert_eq!(rig.ingress(&elsewhere.bytes()), (TC_ACT_UNSPEC, elsewhere.bytes()));
}

#[test]
fn load_balancer_source_ranges_admit_only_listed_clients() {
    let rig = Rig::new(&services());
    let inside = tcp(CLIENT, 40013, LB_IP, 80);
    let (verdict, out) = rig.ingress(&inside.bytes());
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(out, Pkt { src: NODE_IP.into(), sport: sport_of(&out), dst: POD.into(), dport: 8080, ..inside }.bytes());
    let outside = tcp(Ipv4Addr::new(10, 0, 0, 100), 40014, LB_IP, 80);
    assert_eq!(rig.ingress(&outside.bytes()).0, TC_ACT_SHOT, "10.0.0.100 is outside 10.0.0.96/30");
    assert_eq!(rig.counter(counter::TC_DROPPED), 1);
}

/// In each family: IPv4, and IPv6 (no header checksum; the TCP checksum's pseudo header
/// holds 128-bit addresses).
#[test]
fn cluster_ip_tcp_is_translated_both_ways_with_exact_checksums() {
    let rig = Rig::new(&services());
    let families: [(IpAddr, IpAddr, IpAddr); 2] =
        [(CLIENT.into(), CLUSTER_IP.into(), POD.into()), (CLIENT6.into(), CLUSTER_IP6.into(), POD6.into())];
    for (flows, (client, cluster_ip, pod)) in (1..).zip(families) {
        let syn = tcp(client, 40000, cluster_ip, 80);
        let (verdict, out) = rig.ingress(&syn.bytes());
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!(out, Pkt { dst: pod, dport: 8080, ..syn }.bytes(), "DNAT to the backend");

        // A second packet of the flow takes the same path (conntrack), not a new random pick.
        let ack = Pkt { tcp_flags: TCP_ACK, seq: 1001, ack: 5000, ..syn };
        assert_eq!(rig.ingress(&ack.bytes()).1, Pkt { dst: pod, dport: 8080, ..ack }.bytes());

        // The reply, leaving toward the client, gets the ClusterIP back as its source.
        let reply = Pkt { tcp_flags: TCP_SYN | TCP_ACK, seq: 5000, ack: 1001, ..tcp(pod, 8080, client, 40000) };
        let (verdict, out) = rig.egress(&reply.bytes());
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!(out, Pkt { src: cluster_ip, sport: 80, ..reply }.bytes(), "reverse NAT");
        assert_eq!((rig.counter(counter::TC_NEW_FLOW), rig.counter(counter::TC_CT_HIT)), (flows, 2 * flows));
    }
}

/// kpr turns `accept_local` on for its own masqueraded packets; without it the kernel drops an
/// IPv4 packet arriving with one of the node's addresses as source (a martian). On a link where
/// kpr set it (`LINK_FLAG_ACCEPT_LOCAL_SET`), the ingress program drops such packets itself, so
/// a pod cannot send as the node: to a Service (which would take it for the node's own
/// connection) or to anything else. IPv6 has no such check in the kernel; a link where
/// accept_local was on before kpr keeps the kernel's answer.
#[test]
fn a_packet_sent_as_the_node_is_dropped_where_kpr_set_accept_local() {
    let rig = Rig::new(&services());
    let mut links: aya::maps::HashMap<_, u32, LinkInfo> = aya::maps::HashMap::try_from(
        aya::maps::MapData::from_pin(bpf::pin_dir(&rig.pins.0).join(map_names::LINKS))
            .map(aya::maps::Map::HashMap)
            .unwrap(),
    )
    .unwrap();
    // The test run's packets come in by loopback (ifindex 1): make it a link kpr set.
    let flagged =
        LinkInfo { addr: 0, flags: proxy_common::LINK_FLAG_ACCEPT_LOCAL_SET, addr6: Ipv6Addr::UNSPECIFIED.into() };
    links.insert(&1, &flagged, 0).unwrap();
    let as_node = [
        tcp(NODE_IP, 40050, NODE_IP, 30082).bytes(),
        tcp(NODE_IP, 40051, CLUSTER_IP, 80).bytes(),
        udp(NODE_IP, 40052, Ipv4Addr::new(10, 0, 0, 7), 53).bytes(),
    ];
    for packet in &as_node {
        assert_eq!(rig.ingress(packet).0, TC_ACT_SHOT, "sent as the node");
    }
    assert_eq!(rig.counter(counter::TC_DROPPED), 3);
    let from_pod = tcp(Ipv4Addr::new(10, 244, 1, 5), 40053, CLUSTER_IP, 80);
    assert_eq!(rig.ingress(&from_pod.bytes()).1, Pkt { dst: POD.into(), dport: 8080, ..from_pod }.bytes());
    let v6_as_node = tcp(NODE_IP6, 40054, CLUSTER_IP6, 80);
    assert_ne!(rig.ingress(&v6_as_node.bytes()).0, TC_ACT_SHOT, "IPv6: the kernel has no such check");
    // A link where accept_local was already on: the kernel accepts it, and so does kpr.
    links.insert(&1, &LinkInfo { flags: 0, ..flagged }, 0).unwrap();
    assert_ne!(rig.ingress(&as_node[0]).0, TC_ACT_SHOT);
    assert_eq!(rig.counter(counter::TC_DROPPED), 3);
}

/// The attached programs translate a known flow themselves and hand anything else to the slow
/// programs by tail call (`KPR_TC_SLOW_PATH`). With the ingress slot empty, an established flow
/// is still translated, and a new flow's first packet passes untouched, counted.
#[test]
fn a_new_flow_takes_the_slow_program_and_without_it_passes_counted() {
    let mut rig = Rig::new(&services());
    let to_pod = |p: Pkt| Pkt { dst: POD.into(), dport: 8080, ..p }.bytes();
    let syn = tcp(CLIENT, 40200, CLUSTER_IP, 80);
    assert_eq!(rig.ingress(&syn.bytes()), (TC_ACT_OK, to_pod(syn)), "a new flow, by the slow program");
    let mut slots = aya::maps::ProgramArray::try_from(rig.ebpf.map_mut(map_names::TC_SLOW_PATH).unwrap()).unwrap();
    slots.clear_index(&tc_slow_path::INGRESS).unwrap();
    let ack = Pkt { tcp_flags: TCP_ACK, seq: 1001, ack: 5000, ..syn };
    assert_eq!(rig.ingress(&ack.bytes()), (TC_ACT_OK, to_pod(ack)), "the known flow, without the slow program");
    let other = tcp(CLIENT, 40201, CLUSTER_IP, 80);
    assert_eq!(rig.ingress(&other.bytes()), (TC_ACT_UNSPEC, other.bytes()), "a new flow, without it");
    assert_eq!((rig.counter(counter::TC_SLOW_PATH_MISSING), rig.counter(counter::TC_NEW_FLOW)), (1, 1));
}

/// A packet that came in by a link where kpr's ingress program runs was translated there: the
/// egress program leaves it alone. From any other link, or from the node itself, it translates.
#[test]
fn egress_leaves_packets_that_came_in_through_kprs_ingress_alone() {
    let mut rig = Rig::new(&services());
    let syn = tcp(CLIENT, 40100, CLUSTER_IP, 80);
    assert_eq!(rig.ingress(&syn.bytes()).0, TC_ACT_OK);
    {
        let mut links: aya::maps::HashMap<_, u32, LinkInfo> =
            aya::maps::HashMap::try_from(rig.ebpf.map_mut(proxy_common::map_names::LINKS).unwrap()).unwrap();
        links.insert(&7, &LinkInfo { flags: LINK_FLAG_TC_INGRESS, ..LinkInfo::default() }, 0).unwrap();
        links.insert(&8, &LinkInfo::default(), 0).unwrap();
    }
    let reply = Pkt { tcp_flags: TCP_SYN | TCP_ACK, seq: 5000, ack: 1001, ..tcp(POD, 8080, CLIENT, 40100) };
    let translated = Pkt { src: CLUSTER_IP.into(), sport: 80, ..reply }.bytes();
    let egress = program_names::TC_EGRESS;
    assert_eq!(rig.run_from(egress, &reply.bytes(), 7), (TC_ACT_UNSPEC, reply.bytes()), "came in through kpr");
    assert_eq!(rig.run_from(egress, &reply.bytes(), 8), (TC_ACT_OK, translated.clone()), "a link kpr is not on");
    assert_eq!(rig.run_from(egress, &reply.bytes(), 0), (TC_ACT_OK, translated), "the node's own packet");
}

#[test]
fn udp_translation_keeps_a_zero_checksum_zero() {
    let rig = Rig::new(&services());
    let with = udp(CLIENT, 40001, CLUSTER_IP, 53);
    assert_eq!(rig.ingress(&with.bytes()).1, Pkt { dst: POD.into(), dport: 5353, ..with }.bytes());
    let without = Pkt { zero_csum: true, ..udp(CLIENT, 40002, CLUSTER_IP, 53) };
    let (verdict, out) = rig.ingress(&without.bytes());
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(out, Pkt { dst: POD.into(), dport: 5353, ..without }.bytes());
    assert_eq!(&out[40..42], &[0, 0], "UDP checksum stays absent");
}

#[test]
fn node_port_with_cluster_policy_is_masqueraded_and_reversed() {
    let rig = Rig::new(&services());
    let syn = tcp(CLIENT, 40003, NODE_IP, 30080);
    let (verdict, out) = rig.ingress(&syn.bytes());
    assert_eq!(verdict, TC_ACT_OK);
    let nat_port = sport_of(&out);
    let (min, max) = bpf::snat_port_range();
    assert!((min..=max).contains(&nat_port), "SNAT port {nat_port} outside {min}-{max}");
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap();
    let ephemeral: Vec<u16> = ephemeral.split_whitespace().map(|p| p.parse().unwrap()).collect();
    assert!(
        max < ephemeral[0] || min > ephemeral[1],
        "SNAT ports {min}-{max} outside the node's ephemeral ports {ephemeral:?}"
    );
    assert!(max < 30_000 || min > 32_767, "and outside the NodePort range");
    assert_eq!(out, Pkt { src: NODE_IP.into(), sport: nat_port, dst: POD.into(), dport: 8080, ..syn }.bytes());

    // The backend's reply comes back to the node's address and is sent on to the client.
    let reply = Pkt { tcp_flags: TCP_SYN | TCP_ACK, ..tcp(POD, 8080, NODE_IP, nat_port) };
    let (verdict, out) = rig.ingress(&reply.bytes());
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(out, Pkt { src: NODE_IP.into(), sport: 30080, dst: CLIENT.into(), dport: 40003, ..reply }.bytes());
}

/// Maglev (`SERVICE_FLAG_MAGLEV`): a new flow's endpoint is the one the model's table names at
/// the slot of the tuple's hash, seeded with the cluster's `--maglev-seed`, which any node
/// computes alike (whatever its own flow seed). The same tuples to a frontend without the flag
/// are spread by the node's own hash: not the same picks. With the large table size (65,537
/// slots: 33 chunks, the last one partly used; the multinode test has the default).
#[test]
fn a_maglev_frontend_sends_each_tuple_to_its_tables_endpoint() {
    const SEED: u32 = 0x5eed_0047;
    const SIZE: u32 = kpr::model::maglev::LARGE_TABLE_SIZE;
    let backends: Vec<(Ipv4Addr, u16)> = (2..6).map(|n| (Ipv4Addr::new(10, 244, n, 2), 8080)).collect();
    let mut d = Desired::new();
    let (maglev, random) = (30090, 30091);
    for (port, flags) in [(maglev, SERVICE_FLAG_SNAT | SERVICE_FLAG_MAGLEV), (random, SERVICE_FLAG_SNAT)] {
        entry(&mut d, Ipv4Addr::UNSPECIFIED, port, Protocol::Tcp, SCOPE_EXTERNAL, &backends, flags);
    }
    let mut rig = Rig::with(&d, |cfg| {
        cfg.maglev_seed = SEED;
        cfg.maglev_table_size = SIZE;
    });
    let endpoints: Vec<std::net::SocketAddr> = backends.iter().map(|&(ip, port)| (ip, port).into()).collect();
    let table = kpr::model::maglev::table(&endpoints, SIZE, u64::from(SEED)).unwrap();
    let picked = |node_port: u16, sport: u16| {
        let (verdict, out) = rig.ingress(&tcp(CLIENT, sport, NODE_IP, node_port).bytes());
        assert_eq!(verdict, TC_ACT_OK);
        Ipv4Addr::new(out[30], out[31], out[32], out[33])
    };
    let mut differs = 0;
    for sport in 40_100..40_132u16 {
        let hash = proxy_common::tuple_hash(
            SEED,
            &IpAddr::from(CLIENT).into(),
            &IpAddr::from(NODE_IP).into(),
            sport.to_be(),
            maglev.to_be(),
            proxy_common::IPPROTO_TCP,
        );
        let expected = backends[table[(hash % SIZE) as usize] as usize].0;
        assert_eq!(picked(maglev, sport), expected, "the table's endpoint for source port {sport}");
        differs += usize::from(picked(random, sport) != expected);
    }
    assert!(differs > 0, "a random pick took the table's endpoint for all 32 tuples");

    // `kpr verify`'s probes expect the table's endpoint for their own tuples, and the program
    // agrees; a table built with another seed (a node out of step) is found out.
    let mut env = kpr::verify::ProbeEnv::default();
    env.node_port_addrs = vec![NODE_IP.into()];
    env.local_addrs = vec![NODE_IP.into()];
    env.outside_clients = vec![(CLIENT.into(), 0)];
    env.maglev = Some((SEED, SIZE));
    let key = frontend_key(Ipv4Addr::UNSPECIFIED, maglev, Protocol::Tcp, SCOPE_EXTERNAL);
    let programmed = rig.programmer.programmed().clone();
    let disagreeing = |rig: &Rig, runs: std::ops::Range<u64>| {
        runs.filter(|run| {
            let (probes, _) = kpr::verify::probes([&key], &programmed, &env, (*run, 0));
            let (verdict, out) = rig.probe(&probes[0].frame());
            !probes[0].agrees(&probes[0].outcome(verdict, &out), &env.local_addrs)
        })
        .count()
    };
    assert_eq!(disagreeing(&rig, 0..16), 0, "every probe reached the endpoint its tuple's slot names");
    let id = programmed[&key].value.service_id;
    let other = kpr::model::maglev::table(&endpoints, SIZE, u64::from(SEED) + 1).unwrap();
    rig.maps.set_maglev(id, &other).unwrap();
    assert!(disagreeing(&rig, 16..32) > 0, "a table of another seed went unnoticed by 16 probes");
}

#[test]
fn external_ip_with_local_policy_keeps_the_client_address() {
    let rig = Rig::new(&services());
    let syn = tcp(CLIENT, 40004, Ipv4Addr::new(192, 0, 2, 7), 443);
    assert_eq!(rig.ingress(&syn.bytes()).1, Pkt { dst: POD.into(), dport: 8443, ..syn }.bytes());
}

/// A SYN from `client` to `frontend`:`port` (no endpoints) is answered with RST|ACK
/// acknowledging it, sent back out of the interface with the MACs swapped.
fn assert_reset(rig: &Rig, client: impl Into<IpAddr>, sport: u16, frontend: impl Into<IpAddr>, port: u16) {
    let (client, frontend) = (client.into(), frontend.into());
    let syn = tcp(client, sport, frontend, port);
    let (verdict, out) = rig.ingress(&syn.bytes_with_macs([1; 6], [2; 6]));
    assert_eq!(verdict, TC_ACT_REDIRECT, "the reset goes back out of the interface");
    let rst = Pkt {
        src: frontend,
        sport: port,
        dst: client,
        dport: sport,
        tcp_flags: TCP_RST | TCP_ACK,
        seq: 0,
        ack: 1001,
        ..syn
    };
    assert_eq!(out, rst.bytes_with_macs([2; 6], [1; 6]), "RST|ACK acknowledging the SYN, MACs swapped");
}

#[test]
fn no_endpoints_rejects_tcp_with_a_reset_and_local_policy_drops() {
    let rig = Rig::new(&services());
    assert_reset(&rig, CLIENT, 40005, CLUSTER_IP, 81);

    let (verdict, _) = rig.ingress(&tcp(CLIENT, 40006, NODE_IP, 30081).bytes());
    assert_eq!(verdict, TC_ACT_SHOT, "eTP=Local without local endpoints drops");
    let (verdict, _) = rig.ingress(&Pkt { tcp_flags: TCP_ACK, ..tcp(CLIENT, 40007, CLUSTER_IP, 81) }.bytes());
    assert_eq!(verdict, TC_ACT_SHOT, "a non-SYN to a service without endpoints is dropped");
}

#[test]
fn no_endpoints_rejects_udp_with_icmp_port_unreachable() {
    let rig = Rig::new(&services());
    let datagram = udp(CLIENT, 40015, CLUSTER_IP, 54);
    let input = datagram.bytes_with_macs([1; 6], [2; 6]);
    let (verdict, out) = rig.ingress(&input);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    // Expected: Ethernet (swapped) | IPv4 proto 1 from the service to the client | ICMP 3/3 |
    // the original IPv4 header and first 8 bytes of the datagram.
    let quoted = &input[14..14 + 28];
    let mut icmp = vec![3, 3, 0, 0, 0, 0, 0, 0];
    icmp.extend_from_slice(quoted);
    let c = csum(&icmp, 0);
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    let ip = Ip { src: CLUSTER_IP, dst: CLIENT, proto: 1, tos: 0xc0, id: 0, frags: 0 };
    assert_eq!(out, frame(([2; 6], [1; 6]), ip, &icmp));
}

/// A packet between addresses the agent never programmed passes after the address filter's
/// two reads, even with a conntrack entry for its tuple; once one address has its bit, the
/// entry applies.
#[test]
fn packets_between_addresses_kpr_never_programmed_pass_at_the_address_filter() {
    let mut rig = Rig::new(&services());
    let (a, b, c) = (Ipv4Addr::new(10, 1, 1, 1), Ipv4Addr::new(10, 2, 2, 2), Ipv4Addr::new(10, 3, 3, 3));
    let key = CtKey4::new(a.into(), b.into(), 1000u16.to_be(), 2000u16.to_be(), 6);
    let value = CtValue {
        src_addr: a.into(),
        dst_addr: c.into(),
        src_port: 1000u16.to_be(),
        dst_port: 3000u16.to_be(),
        service_id: 1,
        last_seen: monotonic_now(),
        flags: proxy_common::ct::SEEN_REPLY,
        addrs_csum_diff: proxy_common::addrs_csum_diff::<proxy_common::Addr4>(
            &a.into(),
            &b.into(),
            &a.into(),
            &c.into(),
        ),
        route: proxy_common::CachedRoute::NONE,
    };
    rig.table4(proxy_common::map_names::CONNTRACK4).insert(&key, &value, 0).unwrap();
    let packet = Pkt { tcp_flags: TCP_ACK, ..tcp(a, 1000, b, 2000) };
    assert_eq!(rig.ingress(&packet.bytes()), (TC_ACT_UNSPEC, packet.bytes()), "filtered out: untouched");
    rig.maps.mark_addresses([IpAddr::from(b).into()]).unwrap();
    let (verdict, out) = rig.ingress(&packet.bytes());
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(out, Pkt { dst: c.into(), dport: 3000, ..packet }.bytes(), "with its bit set, the flow's entry applies");
}

/// The address filter knows no unallocated address, yet a refused service range still drops a
/// packet to one (the filter's range leg), and leaves an address outside the ranges alone:
/// between two ranges (inside their cover, so the range lookup decides) and past the cover.
#[test]
fn an_unallocated_address_of_a_refused_service_range_is_dropped_past_the_address_filter() {
    let mut rig = Rig::with(&services(), |cfg| cfg.refuse_service_range = true);
    let ranges = [(10, 96), (10, 100)].map(|(a, b)| Cidr::new(Ipv4Addr::new(a, b, 0, 0).into(), 16).unwrap());
    bpf::write_service_ranges(&mut rig.ebpf, &ranges.into()).unwrap();
    for (port, dst) in [(40200, Ipv4Addr::new(10, 96, 7, 7)), (40202, Ipv4Addr::new(10, 100, 7, 7))] {
        let unallocated = tcp(CLIENT, port, dst, 80);
        assert_eq!(rig.ingress(&unallocated.bytes()).0, TC_ACT_SHOT, "{dst}: in a range, no service: dropped");
    }
    for (port, dst) in [(40201, Ipv4Addr::new(10, 97, 7, 7)), (40203, Ipv4Addr::new(10, 104, 7, 7))] {
        let outside = tcp(CLIENT, port, dst, 80);
        assert_eq!(rig.ingress(&outside.bytes()), (TC_ACT_UNSPEC, outside.bytes()), "{dst}: outside the ranges");
    }
}

#[test]
fn sctp_is_translated_both_ways_with_its_crc32c_updated() {
    let rig = Rig::new(&services());
    let init = sctp(CLIENT, 40100, CLUSTER_IP, 3868);
    assert!(sctp_crc_ok(&init.bytes()), "the test's own packet is right");
    let (verdict, out) = rig.ingress(&init.bytes());
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(out, Pkt { dst: POD.into(), dport: 3869, ..init }.bytes(), "DNAT to the backend and its port");
    assert!(sctp_crc_ok(&out), "the CRC32c covers the new port");

    // The backend's INIT ACK, leaving toward the client: the ClusterIP and port come back.
    let init_ack = Pkt { chunk: 2, ..sctp(POD, 3869, CLIENT, 40100) };
    let (verdict, out) = rig.egress(&init_ack.bytes());
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(out, Pkt { src: CLUSTER_IP.into(), sport: 3868, ..init_ack }.bytes(), "reverse NAT");
    assert!(sctp_crc_ok(&out));

    // DATA (chunk 0) of the association: the same backend, from conntrack.
    let data = Pkt { chunk: 0, ..init };
    assert_eq!(rig.ingress(&data.bytes()).1, Pkt { dst: POD.into(), dport: 3869, ..data }.bytes());
    let established = rig.flows().into_iter().filter(|(k, _)| k.proto == 132).collect::<Vec<_>>();
    assert_eq!(established.len(), 2, "one flow, two entries: {established:?}");
    assert!(established.iter().all(|(_, v)| v.flags & proxy_common::ct::SEEN_REPLY != 0), "answered");

    // ABORT closes the association at once, as a RST closes a TCP connection.
    let abort = Pkt { chunk: 6, ..init };
    assert_eq!(rig.ingress(&abort.bytes()).0, TC_ACT_OK);
    let flows: Vec<_> = rig.flows().into_iter().filter(|(k, _)| k.proto == 132).collect();
    assert!(
        flows.len() == 2 && flows.iter().all(|(_, v)| proxy_common::ct::closed(v.flags)),
        "both entries closed after ABORT: {flows:?}"
    );
    assert_eq!(rig.counter(counter::TC_NEW_FLOW), 1);
}

#[test]
fn sctp_node_port_is_masqueraded_and_a_zero_checksum_stays_zero() {
    let rig = Rig::new(&services());
    let init = sctp(CLIENT, 40101, NODE_IP, 30868);
    let (verdict, out) = rig.ingress(&init.bytes());
    assert_eq!(verdict, TC_ACT_OK);
    let nat_port = sport_of(&out);
    assert_ne!(nat_port, 40101, "masquerade gives the flow a port of its own");
    assert_eq!(out, Pkt { src: NODE_IP.into(), sport: nat_port, dst: POD.into(), dport: 3869, ..init }.bytes());
    assert!(sctp_crc_ok(&out), "both ports changed: the CRC32c follows");
    let reply = Pkt { chunk: 2, ..sctp(POD, 3869, NODE_IP, nat_port) };
    let (_, out) = rig.ingress(&reply.bytes());
    assert_eq!(out, Pkt { src: NODE_IP.into(), sport: 30868, dst: CLIENT.into(), dport: 40101, ..reply }.bytes());

    // The sender's kernel left the checksum to the device (0): it stays 0, to be computed over
    // the rewritten packet.
    let offloaded = Pkt { zero_csum: true, ..sctp(CLIENT, 40102, CLUSTER_IP, 3868) };
    let (verdict, out) = rig.ingress(&offloaded.bytes());
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(out, Pkt { dst: POD.into(), dport: 3869, ..offloaded }.bytes());
    assert_eq!(&out[42..46], &[0, 0, 0, 0], "checksum left to the device");
}

#[test]
fn sctp_without_endpoints_gets_icmp_port_unreachable_and_fragments_pass() {
    let rig = Rig::new(&services());
    let init = sctp(CLIENT, 40103, CLUSTER_IP, 3870);
    let input = init.bytes_with_macs([1; 6], [2; 6]);
    let (verdict, out) = rig.ingress(&input);
    assert_eq!(verdict, TC_ACT_REDIRECT, "REJECT: ICMP port unreachable, as iptables REJECTs non-TCP");
    let mut icmp = vec![3, 3, 0, 0, 0, 0, 0, 0];
    icmp.extend_from_slice(&input[14..14 + 28]);
    let c = csum(&icmp, 0);
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    let ip = Ip { src: CLUSTER_IP, dst: CLIENT, proto: 1, tos: 0xc0, id: 0, frags: 0 };
    assert_eq!(out, frame(([2; 6], [1; 6]), ip, &icmp));

    // The first fragment of an SCTP packet in IP fragments: its CRC covers bytes it lacks.
    let first = Pkt { frag: 0x2000, ..sctp(CLIENT, 40104, CLUSTER_IP, 3868) };
    assert_eq!(rig.ingress(&first.bytes()), (TC_ACT_UNSPEC, first.bytes()));
}

/// An ICMP error from `src` to `dst` quoting the first 28 bytes of `quoted` (an IPv4 packet).
fn icmp_error(src: Ipv4Addr, dst: Ipv4Addr, icmp_type: u8, code: u8, rest: [u8; 4], quoted: &[u8]) -> Vec<u8> {
    let mut icmp = vec![icmp_type, code, 0, 0];
    icmp.extend_from_slice(&rest);
    icmp.extend_from_slice(&quoted[..28]);
    let c = csum(&icmp, 0);
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    frame(MACS, Ip { src, dst, proto: 1, tos: 0, id: 0, frags: 0 }, &icmp)
}

#[test]
fn icmp_errors_about_a_translated_flow_are_translated_back() {
    let rig = Rig::new(&services());
    let syn = tcp(CLIENT, 40020, NODE_IP, 30080);
    let out = rig.ingress(&syn.bytes()).1;
    let nat_port = sport_of(&out);
    // The backend says "fragmentation needed, MTU 1400" about a packet it got from the node.
    let as_seen = Pkt { src: NODE_IP.into(), sport: nat_port, dst: POD.into(), dport: 8080, ..syn }.bytes();
    let error = icmp_error(POD, NODE_IP, 3, 4, [0, 0, 0x05, 0x78], &as_seen[14..]);
    let (verdict, out) = rig.ingress(&error);
    assert_eq!(verdict, TC_ACT_OK);
    // The client gets it from the NodePort, quoting the packet as the client sent it.
    let expected = icmp_error(NODE_IP, CLIENT, 3, 4, [0, 0, 0x05, 0x78], &syn.bytes()[14..]);
    assert_eq!(out, expected);
    // An ICMP error about an unknown flow passes untouched.
    let stranger = icmp_error(POD, NODE_IP, 3, 3, [0; 4], &tcp(NODE_IP, 1, POD, 2).bytes()[14..]);
    assert_eq!(rig.ingress(&stranger).1, stranger);

    // The other way: a router on the client's side cannot forward the backend's large reply
    // (as the node sent it on: from the NodePort to the client) and says so to the node. The
    // backend gets it, quoting its reply as it sent it (to the masquerade address and port),
    // so that its path MTU drops.
    let router = Ipv4Addr::new(10, 0, 0, 254);
    let reply_as_sent = Pkt { tcp_flags: TCP_ACK, ..tcp(POD, 8080, NODE_IP, nat_port) };
    let reply_as_forwarded =
        Pkt { src: NODE_IP.into(), sport: 30080, dst: CLIENT.into(), dport: 40020, ..reply_as_sent };
    let error = icmp_error(router, NODE_IP, 3, 4, [0, 0, 0x05, 0x00], &reply_as_forwarded.bytes()[14..]);
    let (verdict, out) = rig.ingress(&error);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        out,
        icmp_error(router, POD, 3, 4, [0, 0, 0x05, 0x00], &reply_as_sent.bytes()[14..]),
        "to the backend, about its own packet"
    );
}

#[test]
fn hairpin_is_masqueraded() {
    let rig = Rig::new(&services());
    let syn = tcp(POD, 40008, CLUSTER_IP, 80);
    let out = rig.ingress(&syn.bytes()).1;
    let nat_port = sport_of(&out);
    assert_eq!(out, Pkt { src: NODE_IP.into(), sport: nat_port, dst: POD.into(), dport: 8080, ..syn }.bytes());
}

/// Untouched packets go on to whatever is attached after kpr (a CNI's or an observability
/// program): TC_ACT_UNSPEC, not TC_ACT_OK, which would end the chain.
#[test]
fn what_is_not_ours_passes_untouched_to_the_next_program() {
    let rig = Rig::new(&services());
    let other = tcp(CLIENT, 40009, Ipv4Addr::new(10, 244, 9, 9), 80);
    // A later fragment (offset 128) of a datagram whose first fragment was never seen.
    let fragment = Pkt { frag: 0x0010, ..tcp(CLIENT, 40010, CLUSTER_IP, 80) };
    let mut arp = tcp(CLIENT, 1, CLUSTER_IP, 80).bytes();
    arp[12..14].copy_from_slice(&[0x08, 0x06]);
    let truncated = tcp(CLIENT, 40011, CLUSTER_IP, 80).bytes()[..40].to_vec();
    let mut options = tcp(CLIENT, 40012, CLUSTER_IP, 80).bytes();
    options[14] = 0x46; // IHL 6: options present
    let before = rig.counter(counter::TC_PASSED_UNSUPPORTED);
    for (what, input) in [
        ("not a service", other.bytes()),
        ("fragment", fragment.bytes()),
        ("ARP", arp),
        ("truncated", truncated),
        ("IP options", options),
    ] {
        for (dir, (verdict, out)) in [("ingress", rig.ingress(&input)), ("egress", rig.egress(&input))] {
            assert_eq!(verdict, TC_ACT_UNSPEC, "{what} ({dir})");
            assert_eq!(out, input, "{what} ({dir}) is unchanged");
        }
    }
    assert_eq!(rig.counter(counter::TC_PASSED_UNSUPPORTED) - before, 4, "fragment and options, both directions");
    assert_eq!(rig.counter(counter::TC_NEW_FLOW), 0);
}

#[test]
fn a_new_connection_reusing_the_tuple_of_a_flow_to_a_removed_endpoint_is_balanced_anew() {
    let mut rig = Rig::new(&services());
    let syn = tcp(CLIENT, 40040, CLUSTER_IP, 80);
    assert_eq!(rig.ingress(&syn.bytes()).1, Pkt { dst: POD.into(), dport: 8080, ..syn }.bytes());
    // The endpoint goes away; another takes its place.
    let other = Ipv4Addr::new(10, 244, 7, 7);
    let mut d = services();
    cluster_ip(&mut d, 80, Protocol::Tcp, &[(other, 8080)]);
    rig.reprogram(&d);
    // Established traffic of the old flow keeps its endpoint...
    let ack = Pkt { tcp_flags: TCP_ACK, seq: 1001, ..syn };
    assert_eq!(rig.ingress(&ack.bytes()).1, Pkt { dst: POD.into(), dport: 8080, ..ack }.bytes());
    // ...but a new SYN on the same 5-tuple goes to a live endpoint.
    assert_eq!(rig.ingress(&syn.bytes()).1, Pkt { dst: other.into(), dport: 8080, ..syn }.bytes());
    // A retransmitted SYN of a live flow stays where it was.
    assert_eq!(rig.ingress(&syn.bytes()).1, Pkt { dst: other.into(), dport: 8080, ..syn }.bytes());
}

/// An established flow's packets that change nothing in its entry are served from this CPU's
/// copy of it (`flow_cache`, no conntrack lookup), and the copy stops serving once conntrack
/// changes: an entry rewritten from userspace (`Conntrack::changed`, which the agent's removals
/// call), or the programs forgetting the flow for a new connection on its tuple.
#[test]
fn an_established_flows_packets_are_served_from_the_flow_cache_until_its_entry_changes() {
    pin_to_cpu(0);
    let mut rig = Rig::new(&services());
    let families: [(IpAddr, IpAddr, IpAddr); 2] =
        [(CLIENT.into(), CLUSTER_IP.into(), POD.into()), (CLIENT6.into(), CLUSTER_IP6.into(), POD6.into())];
    for (client, cluster_ip, pod) in families {
        let syn = tcp(client, 40050, cluster_ip, 80);
        assert_eq!(rig.ingress(&syn.bytes()).1, Pkt { dst: pod, dport: 8080, ..syn }.bytes());
        let synack = Pkt { tcp_flags: TCP_SYN | TCP_ACK, seq: 7000, ack: 1001, ..tcp(pod, 8080, client, 40050) };
        assert_eq!(rig.egress(&synack.bytes()).1, Pkt { src: cluster_ip, sport: 80, ..synack }.bytes());
        let ack = Pkt { tcp_flags: TCP_ACK, seq: 1001, ack: 7001, ..syn };
        let (filled, hits) = (rig.counter(counter::TC_FLOW_CACHE_FILLED), rig.counter(counter::TC_CT_HIT));
        for _ in 0..3 {
            assert_eq!(rig.ingress(&ack.bytes()).1, Pkt { dst: pod, dport: 8080, ..ack }.bytes(), "{client}");
        }
        assert_eq!(rig.counter(counter::TC_CT_HIT) - hits, 3, "{client}");
        assert_eq!(rig.counter(counter::TC_FLOW_CACHE_FILLED) - filled, 1, "{client}: the first ACK filled the cache");
        // A FIN changes the entry: the table's path, not the cache's.
        let fin = Pkt { tcp_flags: TCP_FIN | TCP_ACK, ..ack };
        assert_eq!(rig.ingress(&fin.bytes()).1, Pkt { dst: pod, dport: 8080, ..fin }.bytes(), "{client}");
        let fin_bits = proxy_common::ct::FIN_ORIG;
        let finned = |(k, v): &(CtKey, CtValue)| k.dst_addr == Addr::from(cluster_ip) && v.flags & fin_bits != 0;
        assert!(rig.flows().iter().any(finned), "{client}: the FIN is in the entry");
    }

    // IPv4, a new flow: its entry rewritten from userspace.
    let syn = tcp(CLIENT, 40051, CLUSTER_IP, 80);
    rig.ingress(&syn.bytes());
    rig.egress(&Pkt { tcp_flags: TCP_SYN | TCP_ACK, seq: 7000, ack: 1001, ..tcp(POD, 8080, CLIENT, 40051) }.bytes());
    let ack = Pkt { tcp_flags: TCP_ACK, seq: 1001, ack: 7001, ..syn };
    let to = |dst: Ipv4Addr, dport: u16| Pkt { dst: dst.into(), dport, ..ack }.bytes();
    // The handshake's ACK establishes the flow (its entries move); the next packet fills the cache.
    assert_eq!(rig.ingress(&ack.bytes()).1, to(POD, 8080));
    assert_eq!(rig.ingress(&ack.bytes()).1, to(POD, 8080));
    let key = CtKey4::new(CLIENT.into(), CLUSTER_IP.into(), 40051u16.to_be(), 80u16.to_be(), proxy_common::IPPROTO_TCP);
    let mut table = rig.table4(proxy_common::map_names::CONNTRACK4);
    let mut entry = table.get(&key, 0).unwrap();
    entry.dst_port = 8081u16.to_be();
    table.insert(&key, &entry, 0).unwrap();
    assert_eq!(rig.ingress(&ack.bytes()).1, to(POD, 8080), "behind the cache's back: its copy serves");
    rig.conntrack().changed().unwrap();
    assert_eq!(rig.ingress(&ack.bytes()).1, to(POD, 8081), "the copy no longer serves");
    entry.dst_port = 8080u16.to_be();
    table.insert(&key, &entry, 0).unwrap();
    rig.conntrack().changed().unwrap();
    assert_eq!(rig.ingress(&ack.bytes()).1, to(POD, 8080));
    let filled = rig.counter(counter::TC_FLOW_CACHE_FILLED);
    assert_eq!(rig.ingress(&ack.bytes()).1, to(POD, 8080));
    assert_eq!(rig.counter(counter::TC_FLOW_CACHE_FILLED), filled, "served from the cache again");

    // The endpoint goes away; a new connection on the tuple is balanced anew, the programs
    // forgetting the old flow, and its packets do not get the old flow's copy.
    let other = Ipv4Addr::new(10, 244, 7, 7);
    let mut d = services();
    cluster_ip(&mut d, 80, Protocol::Tcp, &[(other, 8080)]);
    rig.reprogram(&d);
    assert_eq!(rig.ingress(&ack.bytes()).1, to(POD, 8080), "established traffic keeps its endpoint");
    assert_eq!(rig.ingress(&syn.bytes()).1, Pkt { dst: other.into(), dport: 8080, ..syn }.bytes());
    let synack = Pkt { tcp_flags: TCP_SYN | TCP_ACK, seq: 9000, ack: 1001, ..tcp(other, 8080, CLIENT, 40051) };
    assert_eq!(rig.egress(&synack.bytes()).1, Pkt { src: CLUSTER_IP.into(), sport: 80, ..synack }.bytes());
    for _ in 0..2 {
        assert_eq!(rig.ingress(&ack.bytes()).1, to(other, 8080), "the new connection's endpoint");
    }
}

/// `kpr events`: while a reader follows the ring buffer, a reject, a drop of traffic policy
/// Local and one of loadBalancerSourceRanges each make an event with its reason, protocol,
/// source and frontend; forwarded packets make none; once the reader is gone, drops make none.
#[test]
fn drops_and_rejects_are_events_while_a_reader_follows() {
    use kpr::inspect::events::{EventView, follow};
    let rig = Rig::new(&services());
    let pins = rig.pins.0.clone();
    let reader = std::thread::spawn(move || {
        let mut seen = Vec::new();
        follow(&pins, Some(std::time::Duration::from_secs(10)), |e| {
            seen.push(e);
            Ok(seen.len() < 3)
        })
        .unwrap();
        seen
    });
    let wanted = || rig.array_word(map_names::EVENTS_WANTED, 0);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while wanted() < monotonic_now() {
        assert!(std::time::Instant::now() < deadline, "the reader never asked for events");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    // Forwarded: no event.
    assert_eq!(rig.ingress(&tcp(CLIENT, 40070, CLUSTER_IP, 80).bytes()).0, TC_ACT_OK);
    assert_eq!(rig.ingress(&tcp(CLIENT, 40071, CLUSTER_IP, 81).bytes_with_macs([1; 6], [2; 6])).0, TC_ACT_REDIRECT);
    assert_eq!(rig.ingress(&tcp(CLIENT, 40072, NODE_IP, 30081).bytes()).0, TC_ACT_SHOT);
    assert_eq!(rig.ingress(&tcp(Ipv4Addr::new(10, 0, 0, 100), 40073, LB_IP, 80).bytes()).0, TC_ACT_SHOT);
    let seen = reader.join().unwrap();
    let brief: Vec<(&str, &str, String, String)> =
        seen.iter().map(|e: &EventView| (e.reason, e.protocol, e.source.clone(), e.destination.clone())).collect();
    assert_eq!(
        brief,
        [
            ("rejected", "TCP", format!("{CLIENT}:40071"), format!("{CLUSTER_IP}:81")),
            ("dropped_no_local_endpoints", "TCP", format!("{CLIENT}:40072"), format!("{NODE_IP}:30081")),
            ("dropped_source_range", "TCP", "10.0.0.100:40073".to_owned(), format!("{LB_IP}:80")),
        ]
    );
    assert!(seen.iter().all(|e| e.time.parse::<jiff::Timestamp>().is_ok()), "{seen:?}");
    let id = |addr: Ipv4Addr, port: u16| {
        rig.programmer.programmed()[&frontend_key(addr, port, Protocol::Tcp, SCOPE_EXTERNAL)].value.service_id
    };
    let ids: Vec<u32> = seen.iter().map(|e| e.service_id).collect();
    assert_eq!(ids, [id(CLUSTER_IP, 81), id(Ipv4Addr::UNSPECIFIED, 30081), id(LB_IP, 80)], "each event's port");
    // The reader is gone: the programs write nothing.
    assert_eq!(wanted(), 0, "the reader turned the events off");
    assert_eq!(rig.ingress(&tcp(CLIENT, 40074, NODE_IP, 30081).bytes()).0, TC_ACT_SHOT);
    let mut ring = aya::maps::RingBuf::try_from(aya::maps::Map::RingBuf(
        bpf::open_pinned_map(&rig.pins.0, map_names::EVENTS).unwrap(),
    ))
    .unwrap();
    assert!(ring.next().is_none(), "an event written with nobody reading");
}

/// `--abort-dead-tcp`: the agent marks the client's entry of a flow whose endpoint died
/// (`ct::ENDPOINT_DEAD`); the client's next segment, even one the flow cache held, is answered
/// with a RST at its acknowledgement number, from the frontend, back out of the interface, and
/// the flow is forgotten. A SYN on a marked tuple is a new connection, balanced as any.
#[test]
fn a_segment_of_a_flow_whose_endpoint_died_is_answered_with_a_reset() {
    pin_to_cpu(0);
    let rig = Rig::new(&services());
    let flows: [(IpAddr, IpAddr, u16, IpAddr); 3] = [
        (CLIENT.into(), CLUSTER_IP.into(), 80, POD.into()),
        (CLIENT6.into(), CLUSTER_IP6.into(), 80, POD6.into()),
        (CLIENT.into(), NODE_IP.into(), 30080, POD.into()),
    ];
    for (client, frontend, port, pod) in flows {
        let syn = tcp(client, 40060, frontend, port);
        let (_, out) = rig.ingress(&syn.bytes());
        let (src, sport) = (ip_src_of(&out), sport_of(&out));
        let synack = Pkt { tcp_flags: TCP_SYN | TCP_ACK, seq: 7000, ack: 1001, ..tcp(pod, 8080, src, sport) };
        // The pod's answer: on its way out to the client, or (masqueraded) back in to the node.
        if src == client {
            rig.egress(&synack.bytes())
        } else {
            rig.ingress(&synack.bytes())
        };
        let ack = Pkt { tcp_flags: TCP_ACK, seq: 1001, ack: 7001, ..syn };
        for _ in 0..2 {
            assert_eq!(rig.ingress(&ack.bytes()).0, TC_ACT_OK, "{frontend}: established");
        }
        let dead = |k: &CtKey, v: &CtValue| {
            v.flags & proxy_common::ct::REPLY == 0
                && k.dst_addr == Addr::from(frontend)
                && k.src_port == 40060u16.to_be()
        };
        let marked = rig.conntrack().mark_where_in([true, true], proxy_common::ct::ENDPOINT_DEAD, dead).unwrap();
        assert_eq!(marked, 1, "{frontend}: the client's entry");
        let resets = rig.counter(counter::TC_DEAD_FLOW_RESET);
        let data = Pkt { seq: 1001, ack: 7001, ..ack };
        let (verdict, out) = rig.ingress(&data.bytes_with_macs([1; 6], [2; 6]));
        assert_eq!(verdict, TC_ACT_REDIRECT, "{frontend}: back out of the interface");
        let rst =
            Pkt { src: frontend, sport: port, dst: client, dport: 40060, tcp_flags: TCP_RST, seq: 7001, ack: 0, ..syn };
        assert_eq!(out, rst.bytes_with_macs([2; 6], [1; 6]), "{frontend}: a RST at the client's acknowledgement");
        assert_eq!(rig.counter(counter::TC_DEAD_FLOW_RESET) - resets, 1);
        let of_flow = |(k, v): &(CtKey, CtValue)| {
            (k.src_addr == Addr::from(client) && k.src_port == 40060u16.to_be())
                || (v.dst_addr == Addr::from(client) && v.dst_port == 40060u16.to_be())
        };
        assert!(!rig.flows().iter().any(of_flow), "{frontend}: the flow is forgotten");
    }
    // A SYN on the tuple of a marked flow: a new connection to the service.
    let syn = tcp(CLIENT, 40061, CLUSTER_IP, 80);
    rig.ingress(&syn.bytes());
    let of_client = |k: &CtKey, v: &CtValue| v.flags & proxy_common::ct::REPLY == 0 && k.src_port == 40061u16.to_be();
    assert_eq!(rig.conntrack().mark_where_in([true, false], proxy_common::ct::ENDPOINT_DEAD, of_client).unwrap(), 1);
    let (verdict, out) = rig.ingress(&syn.bytes());
    assert_eq!((verdict, out), (TC_ACT_OK, Pkt { dst: POD.into(), dport: 8080, ..syn }.bytes()));
}

/// Each service port's counters: its new flows, the packets and bytes of its flows both ways
/// (those the flow cache served too), the flows its endpoint never answered, and its refusals
/// by reason, each counted for the port the packet was for.
#[test]
fn a_probe_of_kpr_verify_is_decided_as_traffic_but_counted_as_none() {
    pin_to_cpu(0);
    let rig = Rig::new(&services());
    let id = |addr: Ipv4Addr, port: u16| {
        rig.programmer.programmed()[&frontend_key(addr, port, Protocol::Tcp, SCOPE_EXTERNAL)].value.service_id
    };
    let pins = rig.pins.0.clone();
    let word =
        |id: u32, word: u32| bpf::read_service_stats(&pins).unwrap().get(&id).map_or(0, |s| s.words[word as usize]);
    let (web, rejected) = (id(CLUSTER_IP, 80), id(CLUSTER_IP, 81));
    let (new_flows, rejected_count) = (rig.counter(counter::TC_NEW_FLOW), rig.counter(counter::TC_REJECTED));

    // The same decisions as for any packet: a DNAT to the endpoint, a reset for the port
    // without endpoints.
    let (verdict, out) = rig.probe(&tcp(CLIENT, 40090, CLUSTER_IP, 80).bytes());
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(out, tcp(CLIENT, 40090, POD, 8080).bytes());
    let (verdict, out) = rig.probe(&tcp(CLIENT, 40091, CLUSTER_IP, 81).bytes());
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_ne!(out[47] & TCP_RST, 0, "a reset");
    // Its flow is made (the agent takes it back), but nothing counts it as traffic.
    assert_eq!(rig.flows().len(), 2, "the probe's flow, both ways");
    assert_eq!(word(web, service_stat::NEW_FLOWS), 0);
    assert_eq!(word(web, service_stat::PACKETS), 0);
    assert_eq!(word(rejected, service_stat::EVENTS + event::REJECTED), 0);
    assert_eq!(rig.counter(counter::TC_NEW_FLOW), new_flows);
    assert_eq!(rig.counter(counter::TC_REJECTED), rejected_count);

    // The same packets unmarked are counted.
    rig.ingress(&tcp(CLIENT, 40092, CLUSTER_IP, 80).bytes());
    rig.ingress(&tcp(CLIENT, 40093, CLUSTER_IP, 81).bytes());
    assert_eq!(word(web, service_stat::NEW_FLOWS), 1);
    assert_eq!(word(rejected, service_stat::EVENTS + event::REJECTED), 1);
    assert_eq!(rig.counter(counter::TC_NEW_FLOW), new_flows + 1);
    assert_eq!(rig.counter(counter::TC_REJECTED), rejected_count + 1);
}

#[test]
fn each_service_port_counts_its_flows_packets_bytes_and_refusals() {
    pin_to_cpu(0);
    let mut rig =
        Rig::with(&services(), |cfg| cfg.ct_timeouts = CtTimeouts { tcp_syn: 200 * MS, ..CtTimeouts::DEFAULT });
    let id = |addr: Ipv4Addr, port: u16| {
        rig.programmer.programmed()[&frontend_key(addr, port, Protocol::Tcp, SCOPE_EXTERNAL)].value.service_id
    };
    let pins = rig.pins.0.clone();
    let stats = || bpf::read_service_stats(&pins).unwrap();
    let word = |id: u32, word: u32| stats().get(&id).map_or(0, |s| s.words[word as usize]);
    let web = id(CLUSTER_IP, 80);

    // A connection: SYN, answer, ACK, then five segments the flow cache serves but the first.
    let syn = tcp(CLIENT, 40070, CLUSTER_IP, 80);
    let synack = Pkt { tcp_flags: TCP_SYN | TCP_ACK, seq: 7000, ack: 1001, ..tcp(POD, 8080, CLIENT, 40070) };
    let ack = Pkt { tcp_flags: TCP_ACK, seq: 1001, ack: 7001, ..syn };
    let mut sent = vec![syn.bytes(), synack.bytes(), ack.bytes()];
    sent.extend((0..5).map(|_| ack.bytes_with_macs([1; 6], [2; 6])));
    assert_eq!(rig.ingress(&sent[0]).0, TC_ACT_OK);
    assert_eq!(rig.egress(&sent[1]).0, TC_ACT_OK);
    let filled = rig.counter(counter::TC_FLOW_CACHE_FILLED);
    for packet in &sent[2..] {
        assert_eq!(rig.ingress(packet).0, TC_ACT_OK);
    }
    assert_eq!(rig.counter(counter::TC_FLOW_CACHE_FILLED), filled + 1, "the cache served the flow");
    let bytes: usize = sent.iter().map(Vec::len).sum();
    let mut want = proxy_common::ServiceStats::default();
    want.words[service_stat::NEW_FLOWS as usize] = 1;
    want.words[service_stat::PACKETS as usize] = 8;
    want.words[service_stat::BYTES as usize] = bytes as u64;
    assert_eq!(stats().get(&web), Some(&want), "one flow, eight packets of {bytes} bytes");

    // A SYN nobody answers, then sent again once its flow expired: counted unanswered, and
    // balanced as a new flow.
    let lonely = tcp(CLIENT, 40071, CLUSTER_IP, 80);
    rig.ingress(&lonely.bytes());
    std::thread::sleep(std::time::Duration::from_millis(300));
    rig.ingress(&lonely.bytes());
    assert_eq!(word(web, service_stat::UNANSWERED), 1);
    assert_eq!(word(web, service_stat::NEW_FLOWS), 3);

    // Refusals, each for its own port: no endpoints (rejected), a source outside the
    // LoadBalancer's ranges, eTP=Local without a local endpoint.
    let rejected = id(CLUSTER_IP, 81);
    rig.ingress(&tcp(CLIENT, 40072, CLUSTER_IP, 81).bytes_with_macs([1; 6], [2; 6]));
    let outsider = Ipv4Addr::new(10, 0, 0, 50);
    assert_eq!(rig.ingress(&tcp(outsider, 40073, LB_IP, 80).bytes()).0, TC_ACT_SHOT);
    assert_eq!(rig.ingress(&tcp(CLIENT, 40074, NODE_IP, 30081).bytes()).0, TC_ACT_SHOT);
    let refused = |reason: u32| service_stat::EVENTS + reason;
    assert_eq!(word(rejected, refused(event::REJECTED)), 1);
    assert_eq!(word(id(LB_IP, 80), refused(event::DROPPED_SOURCE_RANGE)), 1);
    assert_eq!(word(id(Ipv4Addr::UNSPECIFIED, 30081), refused(event::DROPPED_NO_LOCAL_ENDPOINTS)), 1);
    let refused_ports = [rejected, id(LB_IP, 80), id(Ipv4Addr::UNSPECIFIED, 30081)];
    let all = stats();
    assert_eq!(all.len(), rig.programmer.programmed().len(), "the agent made each frontend's counters");
    for (port, stats) in all {
        let refusals: u64 = stats.words[service_stat::EVENTS as usize..].iter().sum();
        assert_eq!(refusals, u64::from(refused_ports.contains(&port)), "port {port}: {stats:?}");
        assert_eq!(stats.words[service_stat::NEW_FLOWS as usize] == 0, port != web, "port {port}: {stats:?}");
    }

    // The frontend goes: its counters go with it, and its flow's next packets (served by the
    // flow cache, then by the table) bring none back.
    let mut without = services();
    without.retain(|key, _| !(key.addr == Addr::from(IpAddr::from(CLUSTER_IP)) && key.port == 80u16.to_be()));
    rig.reprogram(&without);
    assert!(!stats().contains_key(&web));
    for _ in 0..3 {
        rig.ingress(&sent[3]);
    }
    assert!(!stats().contains_key(&web), "no counters for a removed frontend");
    // Without `--endpoint-counters`: no endpoint has any.
    assert!(bpf::read_endpoint_stats(&pins).unwrap().is_empty());
}

/// `--endpoint-counters`: an endpoint counts its new flows, the packets and bytes of its flows
/// both ways (those the flow cache served too) and its unanswered flows, as its port does;
/// past the cap, an endpoint has no counters; a removed endpoint's go, and come back at zero.
#[test]
fn each_endpoint_counts_its_flows_up_to_the_cap() {
    pin_to_cpu(0);
    let mut d = Desired::new();
    cluster_ip(&mut d, 80, Protocol::Tcp, &[(POD, 8080), (REMOTE_POD, 8080)]);
    let mut rig = Rig::with(&d, |cfg| {
        cfg.endpoint_counters = 1;
        cfg.ct_timeouts = CtTimeouts { tcp_syn: 200 * MS, ..CtTimeouts::DEFAULT };
    });
    let pins = rig.pins.0.clone();
    let endpoints = || bpf::read_endpoint_stats(&pins).unwrap();
    let key = |ip: Ipv4Addr| proxy_common::BackendKey {
        addr: IpAddr::from(ip).into(),
        port: 8080u16.to_be(),
        proto: proxy_common::IPPROTO_TCP,
        _pad: 0,
    };
    // Counted: the first endpoint in order; the other is left to the port's counters.
    assert_eq!(endpoints().keys().copied().collect::<Vec<_>>(), vec![key(POD)]);
    assert_eq!(rig.programmer.endpoints_uncounted(), 1);

    // Connections (SYN, answer, ACK, five more the flow cache serves) until both endpoints
    // had some; what each endpoint's counters must say.
    let mut want: BTreeMap<Ipv4Addr, [u64; 5]> = BTreeMap::new();
    for client_port in 40100..40120 {
        let syn = tcp(CLIENT, client_port, CLUSTER_IP, 80);
        let (verdict, out) = rig.ingress(&syn.bytes());
        assert_eq!(verdict, TC_ACT_OK);
        let endpoint = dst_of(&out);
        let synack =
            Pkt { tcp_flags: TCP_SYN | TCP_ACK, seq: 7000, ack: 1001, ..tcp(endpoint, 8080, CLIENT, client_port) };
        let ack = Pkt { tcp_flags: TCP_ACK, seq: 1001, ack: 7001, ..syn };
        assert_eq!(rig.egress(&synack.bytes()).0, TC_ACT_OK);
        let mut sent = vec![syn.bytes(), synack.bytes()];
        for packet in std::iter::once(ack.bytes()).chain((0..5).map(|_| ack.bytes_with_macs([1; 6], [2; 6]))) {
            assert_eq!(rig.ingress(&packet).0, TC_ACT_OK);
            sent.push(packet);
        }
        let counts = want.entry(endpoint).or_default();
        counts[service_stat::NEW_FLOWS as usize] += 1;
        counts[service_stat::PACKETS as usize] += sent.len() as u64;
        counts[service_stat::BYTES as usize] += sent.iter().map(Vec::len).sum::<usize>() as u64;
        if want.len() == 2 && client_port >= 40103 {
            break;
        }
    }
    assert_eq!(want.len(), 2, "both endpoints picked: {want:?}");
    assert_eq!(endpoints()[&key(POD)].words, want[&POD], "pod's flows, packets and bytes");
    assert!(!endpoints().contains_key(&key(REMOTE_POD)), "past the cap");

    // A SYN nobody answers, sent again once its flow expired: unanswered for its endpoint.
    let lonely = tcp(CLIENT, 40150, CLUSTER_IP, 80);
    let endpoint = dst_of(&rig.ingress(&lonely.bytes()).1);
    std::thread::sleep(std::time::Duration::from_millis(300));
    let again = dst_of(&rig.ingress(&lonely.bytes()).1);
    if endpoint == POD {
        want.get_mut(&POD).unwrap()[service_stat::UNANSWERED as usize] += 1;
    }
    for to in [endpoint, again].into_iter().filter(|e| *e == POD) {
        let counts = want.get_mut(&to).unwrap();
        counts[service_stat::NEW_FLOWS as usize] += 1;
        counts[service_stat::PACKETS as usize] += 1;
        counts[service_stat::BYTES as usize] += lonely.bytes().len() as u64;
    }
    assert_eq!(endpoints()[&key(POD)].words, want[&POD], "with the unanswered SYN (to {endpoint}, then {again})");

    // The endpoint leaves: its counters go, and the other takes the free place; back, it
    // has none (past the cap now).
    let mut without = Desired::new();
    cluster_ip(&mut without, 80, Protocol::Tcp, &[(REMOTE_POD, 8080)]);
    rig.reprogram(&without);
    assert_eq!(endpoints().keys().copied().collect::<Vec<_>>(), vec![key(REMOTE_POD)]);
    // (No flow counted before; the packets its flows' cache slots hold, not yet folded, are
    // added as they fold, as for any endpoint.)
    let remote = endpoints()[&key(REMOTE_POD)].words;
    assert_eq!(remote[..3], [0; 3], "{remote:?}");
    assert!(remote[service_stat::PACKETS as usize] <= want[&REMOTE_POD][service_stat::PACKETS as usize]);
    assert_eq!(rig.programmer.endpoints_uncounted(), 0);
    rig.reprogram(&d);
    assert_eq!(endpoints().keys().copied().collect::<Vec<_>>(), vec![key(REMOTE_POD)]);
    assert_eq!(rig.programmer.endpoints_uncounted(), 1);
}

/// Outlier detection's signal: the first answer of each new flow counted for its endpoint
/// (once, however often it is sent), a RST to a SYN as a refusal, and a flow nobody answered
/// seen among the new flows, named by its endpoint; both families.
#[test]
fn an_endpoints_answers_refusals_and_unanswered_flows_are_seen_per_endpoint() {
    pin_to_cpu(0);
    let rig = Rig::new(&services());
    let mut watch = BackendWatch::open(&rig.pins.0).unwrap();
    // Not wanted (the agent watches no endpoint): nothing is counted.
    rig.ingress(&tcp(CLIENT, 40089, CLUSTER_IP, 80).bytes());
    let synack = Pkt { tcp_flags: TCP_SYN | TCP_ACK, seq: 7000, ack: 1001, ..tcp(POD, 8080, CLIENT, 40089) };
    assert_eq!(rig.egress(&synack.bytes()).0, TC_ACT_OK);
    let web = Endpoint { addr: SocketAddr::new(POD.into(), 8080), protocol: Protocol::Tcp };
    assert_eq!(watch.observe(&BTreeSet::from([web])).unwrap().answers, BTreeMap::new(), "not counted unasked");
    watch.want_answers(true).unwrap();
    let endpoint = |ip: IpAddr, port: u16, protocol| Endpoint { addr: SocketAddr::new(ip, port), protocol };
    let families: [(IpAddr, IpAddr, IpAddr); 2] =
        [(CLIENT.into(), CLUSTER_IP.into(), POD.into()), (CLIENT6.into(), CLUSTER_IP6.into(), POD6.into())];
    for (client, cluster_ip, pod) in families {
        let (web, dns) = (endpoint(pod, 8080, Protocol::Tcp), endpoint(pod, 5353, Protocol::Udp));
        let watched = BTreeSet::from([web, dns]);
        let seen = watch.observe(&watched).unwrap();
        assert_eq!((seen.covered, seen.unanswered, seen.answers), (watched.clone(), BTreeMap::new(), BTreeMap::new()));

        // Answered (its SYN-ACK sent twice), refused, and unanswered.
        rig.ingress(&tcp(client, 40090, cluster_ip, 80).bytes());
        let synack = Pkt { tcp_flags: TCP_SYN | TCP_ACK, seq: 7000, ack: 1001, ..tcp(pod, 8080, client, 40090) };
        for _ in 0..2 {
            assert_eq!(rig.egress(&synack.bytes()).0, TC_ACT_OK);
        }
        rig.ingress(&tcp(client, 40091, cluster_ip, 80).bytes());
        let rst = Pkt { tcp_flags: TCP_RST | TCP_ACK, seq: 0, ack: 1001, ..tcp(pod, 8080, client, 40091) };
        assert_eq!(rig.egress(&rst.bytes()).0, TC_ACT_OK);
        rig.ingress(&tcp(client, 40092, cluster_ip, 80).bytes());
        // A datagram and its answer.
        rig.ingress(&udp(client, 40093, cluster_ip, 53).bytes());
        assert_eq!(rig.egress(&udp(pod, 5353, client, 40093).bytes()).0, TC_ACT_OK);

        let seen = watch.observe(&watched).unwrap();
        let counts = |answered, refused| Answers { answered, refused, unanswered: 0 };
        assert_eq!(seen.answers, BTreeMap::from([(web, counts(1, 1)), (dns, counts(1, 0))]), "{seen:?}");
        assert_eq!(seen.unanswered.keys().collect::<Vec<_>>(), [&web], "{seen:?}");
        assert_eq!(seen.unanswered[&web].len(), 1, "the unanswered SYN only: {seen:?}");
        assert_eq!(watch.observe(&watched).unwrap().unanswered, seen.unanswered, "the same flow, the same id");
        // Not watched: not read.
        assert_eq!(watch.observe(&BTreeSet::from([dns])).unwrap().unanswered, BTreeMap::new());
    }
}

fn ip_src_of(packet: &[u8]) -> IpAddr {
    if packet[12..14] == [0x86, 0xdd] {
        IpAddr::from(<[u8; 16]>::try_from(&packet[22..38]).unwrap())
    } else {
        IpAddr::from([packet[26], packet[27], packet[28], packet[29]])
    }
}

const MS: u64 = 1_000_000;

fn dst_of(packet: &[u8]) -> Ipv4Addr {
    Ipv4Addr::new(packet[30], packet[31], packet[32], packet[33])
}

/// Four endpoints behind a masqueraded TCP NodePort (30090) and a masqueraded UDP one (30053).
fn churn_services() -> Desired {
    let mut d = services();
    let pods: Vec<(Ipv4Addr, u16)> = (1..=4).map(|i| (Ipv4Addr::new(10, 244, 2, i), 8080)).collect();
    entry(&mut d, Ipv4Addr::UNSPECIFIED, 30090, Protocol::Tcp, SCOPE_EXTERNAL, &pods, SERVICE_FLAG_SNAT);
    entry(&mut d, Ipv4Addr::UNSPECIFIED, 30053, Protocol::Udp, SCOPE_EXTERNAL, &[(POD, 5353)], SERVICE_FLAG_SNAT);
    d
}

#[test]
fn an_expired_flow_gives_back_its_snat_port() {
    // Two SNAT ports; unanswered flows live half a second (long enough for a slow emulated VM
    // to send the three packets within it).
    let rig = Rig::with(&churn_services(), |cfg| {
        cfg.snat_ports = (SNAT_PORT_MIN, SNAT_PORT_MIN + 1);
        cfg.ct_timeouts = CtTimeouts { tcp_syn: 500 * MS, udp: 500 * MS, ..CtTimeouts::DEFAULT };
    });
    let client = |i: u8| Ipv4Addr::new(203, 0, 113, i);
    for i in 1..=2 {
        assert_eq!(rig.ingress(&udp(client(i), 5000, NODE_IP, 30053).bytes()).0, TC_ACT_OK, "flow {i} gets a port");
    }
    let third = udp(client(3), 5000, NODE_IP, 30053);
    assert_eq!(rig.ingress(&third.bytes()).0, TC_ACT_SHOT, "both ports taken");
    assert_eq!(rig.counter(counter::TC_SNAT_EXHAUSTED), 1);
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let (verdict, out) = rig.ingress(&third.bytes());
    assert_eq!(verdict, TC_ACT_OK, "the expired flows' ports are taken back");
    assert!((SNAT_PORT_MIN..=SNAT_PORT_MIN + 1).contains(&sport_of(&out)));
    assert!(rig.counter(counter::TC_CT_EXPIRED) >= 1);
}

/// An established flow's packets ask the kernel for the time once per tick of its clock and
/// keep it for the rest of the tick (`now_by_tick`): the time they read still moves, so a flow
/// idle past its timeout is found expired at its next packet, and one within it is not.
#[test]
fn the_time_an_established_flows_packets_read_moves_with_the_clock() {
    let rig = Rig::with(&churn_services(), |cfg| {
        cfg.ct_timeouts = CtTimeouts { tcp_established: 1000 * MS, ..CtTimeouts::DEFAULT };
    });
    let syn = tcp(CLIENT, 41100, NODE_IP, 30090);
    let (_, out) = rig.ingress(&syn.bytes());
    let reply =
        Pkt { tcp_flags: TCP_SYN | TCP_ACK, seq: 7000, ack: 1001, ..tcp(dst_of(&out), 8080, NODE_IP, sport_of(&out)) };
    assert_eq!(rig.ingress(&reply.bytes()).0, TC_ACT_OK, "reply reversed");
    let ack = Pkt { tcp_flags: TCP_ACK, seq: 1001, ack: 7001, ..syn };
    let hits = rig.counter(counter::TC_CT_HIT);
    for _ in 0..3 {
        assert_eq!(rig.ingress(&ack.bytes()).0, TC_ACT_OK);
    }
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert_eq!(rig.ingress(&ack.bytes()).0, TC_ACT_OK);
    assert_eq!(rig.counter(counter::TC_CT_HIT) - hits, 4, "within its timeout the flow is live");
    assert_eq!(rig.counter(counter::TC_CT_EXPIRED), 0);
    std::thread::sleep(std::time::Duration::from_millis(1300));
    rig.ingress(&ack.bytes());
    assert_eq!(rig.counter(counter::TC_CT_EXPIRED), 1, "idle past its timeout, the flow expired");
    assert_eq!(rig.counter(counter::TC_CT_HIT) - hits, 4);
}

#[test]
fn flows_live_by_state_and_the_sweep_removes_ended_ones() {
    let rig = Rig::with(&churn_services(), |cfg| {
        cfg.ct_timeouts = CtTimeouts { tcp_closed: 50 * MS, ..CtTimeouts::DEFAULT };
    });
    // Open three connections through the NodePort: SYN, the backend's SYN-ACK (arriving on
    // the node for the SNAT address), the client's ACK.
    let open = |sport: u16| -> (Pkt, Pkt) {
        let syn = tcp(CLIENT, sport, NODE_IP, 30090);
        let (_, out) = rig.ingress(&syn.bytes());
        let reply = Pkt {
            tcp_flags: TCP_SYN | TCP_ACK,
            seq: 7000,
            ack: 1001,
            ..tcp(dst_of(&out), 8080, NODE_IP, sport_of(&out))
        };
        let (verdict, back) = rig.ingress(&reply.bytes());
        assert_eq!((verdict, sport_of(&back[..])), (TC_ACT_OK, 30090), "reply reversed");
        let ack = Pkt { tcp_flags: TCP_ACK, seq: 1001, ack: 7001, ..syn };
        rig.ingress(&ack.bytes());
        (ack, reply)
    };
    let (reset, _) = open(41000);
    let (fin, fin_reply) = open(41001);
    let (kept, _) = open(41002);
    assert_eq!(rig.conntrack().len(), 6);
    // One is reset by the client; one closed with FINs both ways; one stays established.
    rig.ingress(&Pkt { tcp_flags: TCP_RST, ..reset }.bytes());
    rig.ingress(&Pkt { tcp_flags: TCP_FIN | TCP_ACK, ..fin }.bytes());
    rig.ingress(&Pkt { tcp_flags: TCP_FIN | TCP_ACK, ..fin_reply }.bytes());
    let closed = |v: &CtValue| proxy_common::ct::closed(v.flags);
    assert_eq!(rig.flows().iter().filter(|(_, v)| closed(v)).count(), 4, "both entries of both ended flows are closed");
    std::thread::sleep(std::time::Duration::from_millis(120));
    let sweep =
        rig.conntrack().sweep(&CtTimeouts { tcp_closed: 50 * MS, ..CtTimeouts::DEFAULT }, monotonic_now()).unwrap();
    let want = Sweep { live: 2, expired: 4, ..Sweep::default() };
    assert_eq!(sweep, want, "the ended flows go, the established one stays; none was unanswered");
    let (verdict, out) = rig.ingress(&kept.bytes());
    assert_eq!(
        (verdict, dst_of(&out).octets()[..3].to_vec()),
        (TC_ACT_OK, vec![10, 244, 2]),
        "the established flow still translates"
    );
}

#[test]
fn a_connection_whose_entries_were_evicted_is_recreated_as_it_was() {
    let rig = Rig::new(&churn_services());
    let mut established = Vec::new();
    for sport in 42000..42016 {
        let syn = tcp(CLIENT, sport, NODE_IP, 30090);
        let (_, out) = rig.ingress(&syn.bytes());
        established.push((Pkt { tcp_flags: TCP_ACK, seq: 1001, ack: 7001, ..syn }, out));
    }
    let backends: std::collections::BTreeSet<Ipv4Addr> = established.iter().map(|(_, out)| dst_of(out)).collect();
    assert!(backends.len() > 1, "sixteen connections spread over the endpoints: {backends:?}");
    // Every entry is lost (an LRU under pressure); each connection's next segment brings its
    // flow back with the same endpoint and the same SNAT port.
    assert_eq!(rig.evict(|_, _| true), 32);
    for (ack, syn_out) in &established {
        let (verdict, out) = rig.ingress(&ack.bytes());
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!(
            (dst_of(&out), sport_of(&out)),
            (dst_of(syn_out), sport_of(syn_out)),
            "same endpoint and SNAT port as before"
        );
    }
    assert_eq!(rig.counter(counter::TC_CT_RECREATED), 16);

    // Half a flow lost: the reply entry. The client's next state change puts it back, and
    // the backend's answer is reversed again.
    let (ack, syn_out) = &established[0];
    let snat_port = sport_of(syn_out);
    assert_eq!(rig.evict(|k, _| k.dst_port == snat_port.to_be()), 1);
    rig.ingress(&Pkt { tcp_flags: TCP_FIN | TCP_ACK, ..*ack }.bytes());
    assert_eq!(rig.counter(counter::TC_CT_HEALED), 1);
    let reply = Pkt { tcp_flags: TCP_ACK, seq: 7001, ack: 1002, ..tcp(dst_of(syn_out), 8080, NODE_IP, snat_port) };
    let (verdict, back) = rig.ingress(&reply.bytes());
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        back,
        Pkt { src: NODE_IP.into(), sport: 30090, dst: CLIENT.into(), dport: ack.sport, ..reply }.bytes(),
        "reply reversed to the client"
    );
}

#[test]
fn a_closed_connections_snat_port_goes_to_a_new_one_after_a_second() {
    // One endpoint, one SNAT port. As Linux's NAT does, a closed connection's tuple is reused: here after a
    // second (its last ACK has arrived), long before the closed flow expires.
    let rig = Rig::with(&churn_services(), |cfg| cfg.snat_ports = (SNAT_PORT_MIN, SNAT_PORT_MIN));
    let syn = tcp(CLIENT, 43000, NODE_IP, 30080);
    let (_, out) = rig.ingress(&syn.bytes());
    let synack =
        Pkt { tcp_flags: TCP_SYN | TCP_ACK, seq: 7000, ack: 1001, ..tcp(dst_of(&out), 8080, NODE_IP, sport_of(&out)) };
    assert_eq!(rig.ingress(&synack.bytes()).0, TC_ACT_OK);
    let next = tcp(CLIENT, 43001, NODE_IP, 30080);
    assert_eq!(rig.ingress(&next.bytes()).0, TC_ACT_SHOT, "the only port is held by a live connection");
    rig.ingress(&Pkt { tcp_flags: TCP_RST, seq: 1001, ..syn }.bytes());
    assert_eq!(rig.ingress(&next.bytes()).0, TC_ACT_SHOT, "just closed: its last packets may still come");
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let (verdict, out) = rig.ingress(&next.bytes());
    assert_eq!((verdict, sport_of(&out)), (TC_ACT_OK, SNAT_PORT_MIN), "the closed connection's port is taken over");
}

#[test]
fn a_new_connection_on_a_closed_flows_tuple_starts_over_on_its_entries_unless_the_pick_moved() {
    // Unanswered flows live half a second: long enough for the answer to come in time on a slow
    // emulated VM (a SYN and its answer 50 ms apart were once too far apart there).
    let timeouts = CtTimeouts { tcp_syn: 500 * MS, ..CtTimeouts::DEFAULT };
    let mut rig = Rig::with(&churn_services(), |cfg| cfg.ct_timeouts = timeouts);
    let syn = tcp(CLIENT, 44000, NODE_IP, 30090);
    let (_, first) = rig.ingress(&syn.bytes());
    let (backend, snat_port) = (dst_of(&first), sport_of(&first));
    let synack = Pkt { tcp_flags: TCP_SYN | TCP_ACK, seq: 7000, ack: 1001, ..tcp(backend, 8080, NODE_IP, snat_port) };
    let reversed = Pkt { src: NODE_IP.into(), sport: 30090, dst: CLIENT.into(), dport: 44000, ..synack }.bytes();
    assert_eq!(rig.ingress(&synack.bytes()), (TC_ACT_OK, reversed.clone()));
    rig.ingress(&Pkt { tcp_flags: TCP_ACK, seq: 1001, ack: 7001, ..syn }.bytes());
    let reset = Pkt { tcp_flags: TCP_RST, seq: 1001, ..syn };
    rig.ingress(&reset.bytes());

    // The client's next connection from the same port: translated as the closed flow was
    // (the pick is a hash of the tuple), on the closed flow's entries, back to not answered.
    let new_flows = rig.counter(counter::TC_NEW_FLOW);
    assert_eq!(rig.ingress(&syn.bytes()), (TC_ACT_OK, first.clone()), "same endpoint, same SNAT port");
    assert_eq!(rig.counter(counter::TC_NEW_FLOW), new_flows + 1);
    assert_eq!(rig.table4(proxy_common::map_names::CT_NEW4).iter().count(), 0, "no new-flow entries");
    let flows = rig.flows();
    assert_eq!(flows.len(), 2);
    assert!(flows.iter().all(|(_, v)| v.flags & ct::FLOW_BITS == 0), "both entries start over: {flows:?}");
    assert_eq!(rig.ingress(&synack.bytes()), (TC_ACT_OK, reversed), "the answer is reversed");

    // Closed again and reused without an answer: it lives as long as an unanswered flow.
    rig.ingress(&reset.bytes());
    assert_eq!(rig.ingress(&syn.bytes()).1, first);
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let sweep = rig.conntrack().sweep(&timeouts, monotonic_now()).unwrap();
    assert_eq!((sweep.live, sweep.expired), (0, 2), "the SYN timeout, not the established one");
    assert_eq!(sweep.unanswered.values().sum::<u64>(), 1, "one flow its endpoint never answered");

    // The endpoint leaves; a closed flow's tuple is balanced anew over the others.
    let (_, first) = rig.ingress(&syn.bytes());
    let backend = dst_of(&first);
    let synack =
        Pkt { tcp_flags: TCP_SYN | TCP_ACK, seq: 7000, ack: 1001, ..tcp(backend, 8080, NODE_IP, sport_of(&first)) };
    assert_eq!(rig.ingress(&synack.bytes()).0, TC_ACT_OK);
    rig.ingress(&reset.bytes());
    let mut d = churn_services();
    let others: Vec<(Ipv4Addr, u16)> =
        (1..=4).map(|i| Ipv4Addr::new(10, 244, 2, i)).filter(|ip| *ip != backend).map(|ip| (ip, 8080)).collect();
    entry(&mut d, Ipv4Addr::UNSPECIFIED, 30090, Protocol::Tcp, SCOPE_EXTERNAL, &others, SERVICE_FLAG_SNAT);
    rig.reprogram(&d);
    let (verdict, out) = rig.ingress(&syn.bytes());
    assert_eq!(verdict, TC_ACT_OK);
    assert!(others.iter().any(|(ip, _)| *ip == dst_of(&out)), "{} is one of the others", dst_of(&out));
}

#[test]
fn the_sweep_keeps_a_flow_that_a_new_connection_revives_while_it_walks_the_table() {
    let timeouts = CtTimeouts { tcp_closed: 50 * MS, ..CtTimeouts::DEFAULT };
    let rig = Rig::with(&churn_services(), |cfg| cfg.ct_timeouts = timeouts);
    let syn = tcp(CLIENT, 45000, NODE_IP, 30090);
    let (_, out) = rig.ingress(&syn.bytes());
    let synack =
        Pkt { tcp_flags: TCP_SYN | TCP_ACK, seq: 7000, ack: 1001, ..tcp(dst_of(&out), 8080, NODE_IP, sport_of(&out)) };
    assert_eq!(rig.ingress(&synack.bytes()).0, TC_ACT_OK);
    rig.ingress(&Pkt { tcp_flags: TCP_RST, seq: 1001, ..syn }.bytes());
    std::thread::sleep(std::time::Duration::from_millis(120));
    // The closed flow has expired; while the sweep walks the table, the client connects again
    // from the same port and the backend answers: the new flow's entries take the old keys.
    let now = monotonic_now();
    let revived = std::cell::Cell::new(false);
    let (_, removed) = rig
        .conntrack()
        .remove_where(|key, value| {
            if !revived.replace(true) {
                assert_eq!(rig.ingress(&syn.bytes()).0, TC_ACT_OK);
                assert_eq!(rig.ingress(&synack.bytes()).0, TC_ACT_OK);
            }
            timeouts.expired(key.proto, value, now)
        })
        .unwrap();
    assert_eq!((removed, rig.flows().len()), (0, 2), "the new connection's entries stay");
    let reversed = Pkt { src: NODE_IP.into(), sport: 30090, dst: CLIENT.into(), dport: 45000, ..synack }.bytes();
    assert_eq!(rig.ingress(&synack.bytes()), (TC_ACT_OK, reversed), "its answer is reversed");
}

#[test]
fn one_client_port_to_two_frontends_of_one_backend_keeps_their_replies_apart() {
    // A second ClusterIP with the same endpoint: the two flows' replies (backend → client
    // port) would have one tuple.
    let other = Ipv4Addr::new(10, 96, 0, 77);
    let mut d = services();
    for scope in [SCOPE_POD, SCOPE_EXTERNAL] {
        entry(&mut d, other, 80, Protocol::Tcp, scope, &[(POD, 8080)], 0);
    }
    let rig = Rig::new(&d);
    let connect = |sport: u16, frontend: Ipv4Addr| -> u16 {
        let syn = tcp(CLIENT, sport, frontend, 80);
        let (verdict, out) = rig.ingress(&syn.bytes());
        assert_eq!(verdict, TC_ACT_OK);
        let port = sport_of(&out);
        assert_eq!(out, Pkt { dst: POD.into(), dport: 8080, sport: port, ..syn }.bytes(), "DNAT");
        let synack = Pkt { tcp_flags: TCP_SYN | TCP_ACK, seq: 7000, ack: 1001, ..tcp(POD, 8080, CLIENT, port) };
        let back = Pkt { src: frontend.into(), sport: 80, dport: sport, ..synack }.bytes();
        assert_eq!(rig.egress(&synack.bytes()), (TC_ACT_OK, back), "answered through {frontend}");
        port
    };
    // Both live: the second flow's client port is remapped, and each answer goes back through
    // its own frontend.
    assert_eq!(connect(46000, CLUSTER_IP), 46000);
    let remapped = connect(46000, other);
    assert_ne!(remapped, 46000);
    let data = Pkt { tcp_flags: TCP_PSH | TCP_ACK, seq: 7001, ack: 1001, ..tcp(POD, 8080, CLIENT, 46000) };
    assert_eq!(rig.egress(&data.bytes()).1, Pkt { src: CLUSTER_IP.into(), sport: 80, ..data }.bytes());
    // A flow closed a second ago gives its reply tuple up to a new connection from its port.
    assert_eq!(connect(46001, CLUSTER_IP), 46001);
    rig.ingress(&Pkt { tcp_flags: TCP_RST, seq: 1001, ..tcp(CLIENT, 46001, CLUSTER_IP, 80) }.bytes());
    std::thread::sleep(std::time::Duration::from_millis(1100));
    assert_eq!(connect(46001, other), 46001, "the client's own port, answered through the other frontend");
}

#[test]
fn a_new_connection_whose_tuple_kept_only_an_expired_reply_entry_is_answered() {
    // Closed flows live 50 ms. The sweep removes one entry of an expired flow, then the other
    // a little later; a new connection on the tuple comes in between.
    let timeouts = CtTimeouts { tcp_closed: 50 * MS, ..CtTimeouts::DEFAULT };
    let rig = Rig::with(&services(), |cfg| cfg.ct_timeouts = timeouts);
    let syn = tcp(CLIENT, 47000, CLUSTER_IP, 80);
    let synack = Pkt { tcp_flags: TCP_SYN | TCP_ACK, seq: 7000, ack: 1001, ..tcp(POD, 8080, CLIENT, 47000) };
    let reversed = Pkt { src: CLUSTER_IP.into(), sport: 80, ..synack }.bytes();
    rig.ingress(&syn.bytes());
    assert_eq!(rig.egress(&synack.bytes()), (TC_ACT_OK, reversed.clone()));
    rig.ingress(&Pkt { tcp_flags: TCP_RST, seq: 1001, ..syn }.bytes());
    std::thread::sleep(std::time::Duration::from_millis(120));
    assert_eq!(rig.evict(|k, _| k.src_port == 47000u16.to_be()), 1, "the client's entry goes first");
    assert_eq!(rig.ingress(&syn.bytes()).1, Pkt { dst: POD.into(), dport: 8080, ..syn }.bytes());
    assert_eq!(rig.egress(&synack.bytes()), (TC_ACT_OK, reversed), "the answer is reversed");
}

/// A UDP datagram of `payload` in two fragments split after `first` payload bytes (a multiple
/// of 8), with checksums computed from scratch over the whole datagram.
fn udp_fragments(
    src: Ipv4Addr,
    sport: u16,
    dst: Ipv4Addr,
    dport: u16,
    payload: &[u8],
    first: usize,
    id: u16,
) -> (Vec<u8>, Vec<u8>) {
    let mut udp = Vec::new();
    udp.extend_from_slice(&sport.to_be_bytes());
    udp.extend_from_slice(&dport.to_be_bytes());
    udp.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    udp.extend_from_slice(&[0, 0]);
    udp.extend_from_slice(payload);
    let c = l4_csum(src.into(), dst.into(), 17, &udp);
    udp[6..8].copy_from_slice(&(if c == 0 { 0xffff } else { c }).to_be_bytes());
    let split = 8 + first;
    let ip = |frags: u16| Ip { src, dst, proto: 17, tos: 0, id, frags };
    (frame(MACS, ip(0x2000), &udp[..split]), frame(MACS, ip((split / 8) as u16), &udp[split..]))
}

#[test]
fn a_large_reply_in_fragments_is_translated_whole() {
    let rig = Rig::new(&churn_services());
    // A client's query through the masqueraded UDP NodePort 30053...
    let query = udp(CLIENT, 5300, NODE_IP, 30053);
    let (verdict, out) = rig.ingress(&query.bytes());
    assert_eq!(verdict, TC_ACT_OK);
    let nat_port = sport_of(&out);
    // ...and the backend's answer, too large for one packet: two fragments, the second
    // without ports. Both reach the client from the NodePort.
    let answer: Vec<u8> = (0..1800u32).map(|i| (i % 251) as u8).collect();
    let (first, second) = udp_fragments(POD, 5353, NODE_IP, nat_port, &answer, 1400, 0x4242);
    let (expected_first, expected_second) = udp_fragments(NODE_IP, 30053, CLIENT, 5300, &answer, 1400, 0x4242);
    assert_eq!(rig.ingress(&first), (TC_ACT_OK, expected_first), "first fragment: addresses, ports, checksums");
    assert_eq!(rig.ingress(&second), (TC_ACT_OK, expected_second), "later fragment: the same addresses");
    assert_eq!(rig.counter(counter::TC_FRAGMENT_TRANSLATED), 1);
}

#[test]
fn a_flood_of_new_flows_cannot_evict_established_ones() {
    // Tables of 64 entries each; eight established NodePort connections (answered), then 2000
    // SYNs from spoofed sources that are never answered.
    let rig = Rig::with(&churn_services(), |cfg| {
        cfg.max_conntrack = 64;
        cfg.max_conntrack_new = 64;
    });
    let mut acks = Vec::new();
    for sport in 44000..44008 {
        let syn = tcp(CLIENT, sport, NODE_IP, 30090);
        let (_, out) = rig.ingress(&syn.bytes());
        let synack = Pkt {
            tcp_flags: TCP_SYN | TCP_ACK,
            seq: 7000,
            ack: 1001,
            ..tcp(dst_of(&out), 8080, NODE_IP, sport_of(&out))
        };
        assert_eq!(rig.ingress(&synack.bytes()).0, TC_ACT_OK);
        let ack = Pkt { tcp_flags: TCP_ACK, seq: 1001, ack: 7001, ..syn };
        assert_eq!(rig.ingress(&ack.bytes()).0, TC_ACT_OK, "the handshake's last ACK");
        acks.push(ack);
    }
    assert_eq!(rig.conntrack().lens(), (16, 0), "answered and acknowledged: established");
    for i in 0..2000u32 {
        let spoofed = Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 0, 0)) + i);
        rig.ingress(&tcp(spoofed, 1024 + (i % 60000) as u16, NODE_IP, 30090).bytes());
    }
    let (established, new) = rig.conntrack().lens();
    assert_eq!(established, 16, "the flood stayed among the new flows");
    assert!(new <= 64, "{new}");
    for ack in &acks {
        assert_eq!(rig.ingress(&ack.bytes()).0, TC_ACT_OK);
    }
    assert_eq!(rig.counter(counter::TC_CT_RECREATED), 0, "every established connection still had its flow");
}

/// netfilter's conntrack never evicts an established flow to make room (only unassured ones,
/// `early_drop`), and kpr's established table is no LRU either: with room for 8 flows, 24
/// connections answered one after the other. The first 8 are established; the other 16, answered
/// while it is full, live on among the new flows. Every one keeps talking both ways, the
/// backend's segment first: none finds its flow gone (under an LRU, a flow whose replies' entry
/// went could not be found from its next reply, and the node reset it).
#[test]
fn a_full_established_table_evicts_nothing_and_answered_flows_live_on_among_the_new() {
    let rig = Rig::with(&churn_services(), |cfg| {
        cfg.max_conntrack = 16;
        cfg.max_conntrack_new = 256;
    });
    let mut flows = Vec::new();
    for sport in 45000..45024 {
        let syn = tcp(CLIENT, sport, NODE_IP, 30090);
        let (_, out) = rig.ingress(&syn.bytes());
        let (backend, snat_port) = (dst_of(&out), sport_of(&out));
        let synack =
            Pkt { tcp_flags: TCP_SYN | TCP_ACK, seq: 7000, ack: 1001, ..tcp(backend, 8080, NODE_IP, snat_port) };
        assert_eq!(rig.ingress(&synack.bytes()).0, TC_ACT_OK);
        let ack = Pkt { tcp_flags: TCP_ACK, seq: 1001, ack: 7001, ..syn };
        assert_eq!(rig.ingress(&ack.bytes()).0, TC_ACT_OK, "the handshake's last ACK");
        flows.push((ack, backend, snat_port));
    }
    for (ack, backend, snat_port) in &flows {
        let reply = Pkt { tcp_flags: TCP_ACK, seq: 7001, ack: 1001, ..tcp(*backend, 8080, NODE_IP, *snat_port) };
        assert_eq!(
            rig.ingress(&reply.bytes()),
            (
                TC_ACT_OK,
                Pkt { src: NODE_IP.into(), sport: 30090, dst: CLIENT.into(), dport: ack.sport, ..reply }.bytes()
            ),
            "the backend's segment reversed to the client ({}:{})",
            backend,
            snat_port
        );
        let (verdict, out) = rig.ingress(&ack.bytes());
        assert_eq!((verdict, dst_of(&out), sport_of(&out)), (TC_ACT_OK, *backend, *snat_port));
    }
    assert_eq!(rig.counter(counter::TC_CT_RECREATED), 0, "no flow had to be made again");
    assert_eq!(rig.conntrack().lens(), (16, 32), "8 flows established, 16 kept among the new");
    assert_eq!(rig.counter(counter::TC_CT_ESTABLISHED_FULL), 16);
}

/// nf_conntrack's SYN_RECV: a flow the backend answered is established only by the client's
/// ACK of that answer. Until then it stays among the new flows on the SYN timeout, so SYNs
/// whose SYN-ACKs are never acknowledged (spoofed sources) give their SNAT ports back after
/// a minute, not after the established timeout of a day; the ACK moves it to the
/// established table, where it lives by the established timeout.
#[test]
fn an_answer_the_client_never_acknowledges_holds_its_flow_for_the_syn_timeout_only() {
    let timeouts = CtTimeouts { tcp_syn: 500 * MS, ..CtTimeouts::DEFAULT };
    let rig = Rig::with(&churn_services(), |cfg| cfg.ct_timeouts = timeouts);
    let answer_of = |sport: u16| {
        let (_, out) = rig.ingress(&tcp(CLIENT, sport, NODE_IP, 30090).bytes());
        let synack = Pkt {
            tcp_flags: TCP_SYN | TCP_ACK,
            seq: 7000,
            ack: 1001,
            ..tcp(dst_of(&out), 8080, NODE_IP, sport_of(&out))
        };
        assert_eq!(rig.ingress(&synack.bytes()).0, TC_ACT_OK, "the answer is reversed");
    };
    // Ten answered, never acknowledged; one answered and acknowledged.
    for sport in 45000..45010 {
        answer_of(sport);
    }
    answer_of(45100);
    let ack = Pkt { tcp_flags: TCP_ACK, seq: 1001, ack: 7001, ..tcp(CLIENT, 45100, NODE_IP, 30090) };
    assert_eq!(rig.ingress(&ack.bytes()).0, TC_ACT_OK);
    assert_eq!(rig.conntrack().lens(), (2, 20), "the acknowledged flow established, the others not");
    let awaiting = rig.flows().iter().filter(|(_, v)| v.flags & ct::AWAITING_ACK != 0).count();
    assert_eq!(awaiting, 20, "SYN_RECV, both entries of each");
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let mut conntrack = rig.conntrack();
    let sweep = conntrack.sweep(&timeouts, monotonic_now()).unwrap();
    let want = Sweep { live: 2, expired: 20, ..Sweep::default() };
    assert_eq!(sweep, want, "the SYN timeout for the unacknowledged ones (answered: none unanswered)");
    let live: Vec<(&str, usize)> = conntrack.table_use().iter().map(|t| (t.name, t.live)).collect();
    assert_eq!(
        live,
        [
            ("conntrack_established_v4", 2),
            ("conntrack_new_v4", 0),
            ("conntrack_established_v6", 0),
            ("conntrack_new_v6", 0)
        ],
        "each table's entries after the sweep (what kpr_map_entries and the pressure alarm see)"
    );
    assert_eq!(rig.ingress(&ack.bytes()).0, TC_ACT_OK);
    assert_eq!(rig.counter(counter::TC_CT_RECREATED), 0, "the established one kept its flow");
}

/// Run this thread on CPU `cpu` only.
fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is empty; CPU_SET and sched_setaffinity only touch it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        assert_eq!(libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set), 0, "pin to CPU {cpu}");
    }
}

#[test]
fn the_same_syn_on_two_cpus_at_once_makes_one_flow() {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    let rig = Rig::new(&churn_services());
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    // A SYN and its retransmission (or a SYN seen on two queues) handled by two CPUs at once,
    // in rounds until the CPUs have really raced (or give up: one CPU cannot race).
    let (mut flows, mut next_port) = (0usize, 20000u16);
    while flows < 20_000 && (flows == 0 || cpus >= 2 && rig.counter(counter::TC_CT_RACE_ADOPTED) == 0) {
        let syns: Vec<Vec<u8>> = (0..1000).map(|i| tcp(CLIENT, next_port + i, NODE_IP, 30090).bytes()).collect();
        next_port += 1000;
        flows += syns.len();
        let arrived = AtomicUsize::new(0);
        let [first, second]: [Vec<(u32, Vec<u8>)>; 2] = std::thread::scope(|s| {
            let run = |cpu: usize| {
                let (rig, syns, arrived) = (&rig, &syns, &arrived);
                s.spawn(move || {
                    pin_to_cpu(cpu % cpus);
                    let mut outputs = Vec::new();
                    for (i, syn) in syns.iter().enumerate() {
                        // Both threads send each SYN together: a spin barrier (a sleeping one
                        // wakes microseconds apart, longer than the program runs).
                        arrived.fetch_add(1, SeqCst);
                        let mut spins = 0u32;
                        while arrived.load(SeqCst) < 2 * (i + 1) {
                            spins += 1;
                            if spins.is_multiple_of(10_000) {
                                std::thread::yield_now();
                            }
                            std::hint::spin_loop();
                        }
                        outputs.push(rig.ingress(syn));
                    }
                    outputs
                })
            };
            let (a, b) = (run(0), run(1));
            [a.join().unwrap(), b.join().unwrap()]
        });
        for (i, (a, b)) in first.iter().zip(&second).enumerate() {
            assert_eq!(a.0, TC_ACT_OK, "SYN {i}");
            assert_eq!(a, b, "SYN {i}: both CPUs gave it the same endpoint and SNAT port");
        }
    }
    let raced = rig.counter(counter::TC_CT_RACE_ADOPTED);
    eprintln!("{raced} of {flows} SYN pairs raced ({cpus} CPUs)");
    if cpus >= 2 {
        assert!(raced > 0, "in {flows} SYN pairs the two CPUs never raced: nothing was tested");
    }
    // One flow per tuple: its two entries and nothing else (no second SNAT port held).
    assert_eq!(rig.flows().len(), 2 * flows);
    let (new, hit) = (rig.counter(counter::TC_NEW_FLOW), rig.counter(counter::TC_CT_HIT));
    assert_eq!(new + hit, flows as u64 * 2, "each SYN made or found its flow");
}

/// `frame` (Ethernet + IPv4) with TTL `ttl` and its header checksum computed anew.
fn with_ttl(frame: Vec<u8>, ttl: u8) -> Vec<u8> {
    let id = u16::from_be_bytes([frame[18], frame[19]]);
    with_id_ttl(frame, id, ttl)
}

/// `frame` (Ethernet + IPv4) with IP id `id`, TTL `ttl` and its header checksum computed anew.
fn with_id_ttl(mut frame: Vec<u8>, id: u16, ttl: u8) -> Vec<u8> {
    frame[18..20].copy_from_slice(&id.to_be_bytes());
    frame[22] = ttl;
    frame[24..26].copy_from_slice(&[0, 0]);
    let c = csum(&frame[14..34], 0);
    frame[24..26].copy_from_slice(&c.to_be_bytes());
    frame
}

/// A node of our own: the pods are routed over a link (`out0`), forwarding is on; the client
/// is not routed at all.
fn forwarding_node(tag: &str) -> testbed::Netns {
    let ns = testbed::Netns::new(&testbed::unique_name(tag)).unwrap();
    ns.ip(&["link", "add", "out0", "type", "veth", "peer", "name", "out1"]).unwrap();
    ns.ip(&["link", "set", "out1", "up"]).unwrap();
    ns.ip(&["link", "set", "out0", "up"]).unwrap();
    ns.ip(&["route", "add", "10.244.0.0/16", "dev", "out0"]).unwrap();
    ns.sh("echo 1 > /proc/sys/net/ipv4/ip_forward").unwrap();
    ns
}

#[test]
fn translated_packets_go_straight_out_of_the_link_their_route_takes() {
    let ns = forwarding_node("kt-fwd");
    ns.run(|| {
        let rig = Rig::with(&services(), |cfg| cfg.forward_direct = bpf::ForwardDirect::Always);
        let syn = tcp(CLIENT, 40003, NODE_IP, 30080);
        let (verdict, out) = rig.ingress(&syn.bytes());
        assert_eq!(verdict, TC_ACT_REDIRECT, "sent out of out0, not into the host stack");
        let nat_port = sport_of(&out);
        let expected = Pkt { src: NODE_IP.into(), sport: nat_port, dst: POD.into(), dport: 8080, ..syn }.bytes();
        assert_eq!(out, with_ttl(expected.clone(), 63), "translated, one hop older");
        assert_eq!(rig.counter(counter::TC_FORWARDED_DIRECT), 1);
        // Every TTL the packet may come with, and the IP ids that put its header checksum where
        // one TTL less carries: the checksum taken down with the TTL (the kernel's
        // `ip_decrease_ttl` arithmetic) is the one computed anew.
        let (mut sent, mut carried) = (1, 0);
        for id in 0..=255 {
            for ttl in 2..=255 {
                // The translated header's checksum, before the hop, as a native word (the
                // sum's bytes swapped): it overflows at +1.
                let translated = with_id_ttl(expected.clone(), id, ttl);
                let carries = u16::from_le_bytes([translated[24], translated[25]]) >= 0xfffe;
                if id != 0 && !carries {
                    continue;
                }
                let (_, out) = rig.ingress(&with_id_ttl(syn.bytes(), id, ttl));
                assert_eq!(out, with_id_ttl(expected.clone(), id, ttl - 1), "TTL {ttl}, IP id {id}");
                (sent, carried) = (sent + 1, carried + u32::from(carries));
            }
        }
        assert!(carried > 0, "no packet whose checksum carries");
        assert_eq!(rig.counter(counter::TC_FORWARDED_DIRECT), sent);

        // A TTL about to run out: left to the host stack (which answers "time exceeded").
        let (verdict, out) = rig.ingress(&with_ttl(tcp(CLIENT, 40004, NODE_IP, 30080).bytes(), 1));
        assert_eq!((verdict, out[22]), (TC_ACT_OK, 1));
        // The reply, to a client this node has no route to: the host stack decides.
        let reply = Pkt { tcp_flags: TCP_SYN | TCP_ACK, ..tcp(POD, 8080, NODE_IP, nat_port) };
        let (verdict, out) = rig.ingress(&reply.bytes());
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!(out, Pkt { src: NODE_IP.into(), sport: 30080, dst: CLIENT.into(), dport: 40003, ..reply }.bytes());
        // Forwarding off: nothing is forwarded behind the node's back.
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "0").unwrap();
        let (verdict, _) = rig.ingress(&tcp(CLIENT, 40005, NODE_IP, 30080).bytes());
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!(rig.counter(counter::TC_FORWARDED_DIRECT), sent);
    })
    .unwrap();
}

/// Waits, if it must, until early in a period of the kept routes' clock, and returns that
/// period: far enough in that the programs' coarse clock (up to a tick behind
/// CLOCK_MONOTONIC) is in it too, and early enough that a test's few packets and `ip`
/// commands end in it.
fn early_in_a_route_period() -> u32 {
    let period_ns = 1u64 << ct::ROUTE_PERIOD_SHIFT;
    let settled = 20_000_000; // a tick is at most 10 ms (HZ=100)
    let into = monotonic_now() % period_ns;
    if into < settled {
        std::thread::sleep(std::time::Duration::from_nanos(settled - into));
    } else if into > period_ns / 4 {
        std::thread::sleep(std::time::Duration::from_nanos(period_ns - into + settled));
    }
    period_now()
}

/// The kept routes' period CLOCK_MONOTONIC is in now.
fn period_now() -> u32 {
    (monotonic_now() >> ct::ROUTE_PERIOD_SHIFT) as u32
}

#[test]
fn an_established_flow_keeps_its_route_for_about_a_second() {
    let ns = forwarding_node("kt-rc");
    ns.run(move || {
        // The route lookup skips the neighbour table, and so can be kept, from 6.3 on.
        let cached = aya::util::KernelVersion::current().unwrap() >= aya::util::KernelVersion::new(6, 3, 0);
        let out0 = unsafe { libc::if_nametoindex(c"out0".as_ptr()) };
        // In-process (rtnetlink): changed within a route period.
        let pods = (IpAddr::from(Ipv4Addr::new(10, 244, 0, 0)), 16);
        let route = |add: bool| kpr_tests::device_route(add, pods.0, pods.1, out0).unwrap();
        let rig = Rig::with(&services(), |cfg| cfg.forward_direct = bpf::ForwardDirect::Always);
        // The kept route must be checked within the period it was kept in (1.07 s; the program
        // reads the coarse clock, a tick behind). Each attempt starts early in a period, and
        // one whose packets did not all fall in it starts over on a new tuple in the next,
        // until one does (only packets and in-process route changes are in that window).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        let mut attempt = 0u16;
        let (ack, key, forwarded) = loop {
            let period = early_in_a_route_period();
            let forwarded = rig.counter(counter::TC_FORWARDED_DIRECT);
            let syn = tcp(CLIENT, 40010 + attempt, NODE_IP, 30080);
            let (verdict, out) = rig.ingress(&syn.bytes());
            assert_eq!(verdict, TC_ACT_REDIRECT);
            // The backend answers (the client has no route here: the host stack decides).
            let reply = Pkt { tcp_flags: TCP_SYN | TCP_ACK, ..tcp(POD, 8080, NODE_IP, sport_of(&out)) };
            assert_eq!(rig.ingress(&reply.bytes()).0, TC_ACT_OK);
            let key = CtKey4::new(CLIENT.into(), NODE_IP.into(), syn.sport.to_be(), 30080u16.to_be(), 6);
            // The client's next segment: looked up, and the answer kept in its entry.
            let ack = Pkt { tcp_flags: TCP_ACK, seq: 1001, ack: 7001, ..syn };
            assert_eq!(rig.ingress(&ack.bytes()).0, TC_ACT_REDIRECT);
            // The route is gone: for the rest of the period, the flow keeps the one it had...
            route(false);
            let verdict = rig.ingress(&ack.bytes()).0;
            let in_period = period_now() == period;
            if !in_period {
                route(true);
                attempt += 1;
                assert!(std::time::Instant::now() < deadline, "no attempt fit a route period in 120 s");
                continue;
            }
            let kept = rig.table4(proxy_common::map_names::CONNTRACK4).get(&key, 0).unwrap().route;
            if cached {
                assert_eq!(
                    (kept.ifindex, kept.mtu, kept.family, kept.next_hop[0]),
                    (out0, 1500, libc::AF_INET as u8, u32::from_ne_bytes(POD.octets())),
                    "out0, its MTU, and the pod itself as the next hop"
                );
            } else {
                assert_eq!(kept, proxy_common::CachedRoute::NONE);
            }
            assert_eq!(verdict, if cached { TC_ACT_REDIRECT } else { TC_ACT_OK });
            break (ack, key, forwarded);
        };
        let entry = || rig.table4(proxy_common::map_names::CONNTRACK4).get(&key, 0).unwrap();
        // ...but a packet too long for the link takes the lookup, and so the host stack.
        let mut long = ack.bytes();
        long.resize(14 + 1501, 0);
        assert_eq!(rig.ingress(&long).0, TC_ACT_OK);
        let forwarded_now = rig.counter(counter::TC_FORWARDED_DIRECT);
        assert_eq!(
            forwarded_now - forwarded,
            if cached { 3 } else { 2 },
            "the SYN, the first ACK, the ACK by the kept route"
        );
        // In the next period of the clock (here: the kept route made a period older), the
        // lookup is made again, and finds no route.
        let mut aged = entry();
        // (Before 6.3 nothing is kept: period 0, made the last one.)
        aged.route.period = aged.route.period.wrapping_sub(1);
        rig.table4(proxy_common::map_names::CONNTRACK4).insert(&key, &aged, 0).unwrap();
        // A rewrite from userspace: the flow caches' copies of the entry stop serving.
        rig.conntrack().changed().unwrap();
        assert_eq!(rig.ingress(&ack.bytes()).0, TC_ACT_OK);
        assert_eq!(entry().route, aged.route, "nothing new kept");
        // The route back: the next segment is sent by it, and keeps it again, for this period.
        route(true);
        let period = early_in_a_route_period();
        assert_eq!(rig.ingress(&ack.bytes()).0, TC_ACT_REDIRECT);
        if cached {
            assert_eq!((entry().route.ifindex, entry().route.period), (out0, period));
        }
        assert_eq!(rig.counter(counter::TC_FORWARDED_DIRECT), forwarded_now + 1);
    })
    .unwrap();
}

#[test]
fn a_new_flow_keeps_the_routes_its_first_packet_and_its_answer_took() {
    let ns = forwarding_node("kt-rk");
    ns.sh("echo 1 > /proc/sys/net/ipv6/conf/all/forwarding").unwrap();
    let name = ns.name.clone();
    ns.run(move || {
        // Kept from 6.3 on (as above).
        let cached = aya::util::KernelVersion::current().unwrap() >= aya::util::KernelVersion::new(6, 3, 0);
        let ip = |args: &[&str]| testbed::ip(&[&["-n", name.as_str()], args].concat()).unwrap();
        // Per family: the client, the node, the ClusterIP, the backend; the pods' and the
        // client's routes.
        type Family = (IpAddr, IpAddr, IpAddr, IpAddr, [&'static str; 2], &'static str);
        let families: [Family; 2] = [
            (CLIENT.into(), NODE_IP.into(), CLUSTER_IP.into(), POD.into(), ["10.244.0.0/16", "10.0.0.99/32"], "-4"),
            (
                CLIENT6.into(),
                NODE_IP6.into(),
                CLUSTER_IP6.into(),
                POD6.into(),
                ["fd00:10:244::/48", "fd00::99/128"],
                "-6",
            ),
        ];
        let out0 = unsafe { libc::if_nametoindex(c"out0".as_ptr()) };
        // In-process (rtnetlink): they are changed within a route period.
        let routes = |add: bool, prefixes: [(IpAddr, u8); 2]| {
            for (prefix, len) in prefixes {
                kpr_tests::device_route(add, prefix, len, out0).unwrap();
            }
        };
        let mut rig = Rig::with(&services(), |cfg| cfg.forward_direct = bpf::ForwardDirect::Always);
        // out0 with addresses of its own, the masquerade addresses of what leaves by it: the
        // new flow's lookup of that address is its first packet's route.
        let mut links: aya::maps::HashMap<_, u32, LinkInfo> =
            aya::maps::HashMap::try_from(rig.ebpf.map_mut(proxy_common::map_names::LINKS).unwrap()).unwrap();
        let out0_link = LinkInfo { addr: u32::from(NODE_IP).to_be(), flags: 0, addr6: NODE_IP6.into() };
        links.insert(&out0, &out0_link, 0).unwrap();
        let rig = rig;
        // The route an established entry keeps: link, MTU, family, next hop (as the kernel's
        // lookup answers it: an IPv4 address in the first word), period.
        let kept = |key: &CtKey| {
            let (_, entry) = rig.flows().into_iter().find(|(k, _)| k == key).expect("an established entry");
            let r = entry.route;
            (r.ifindex, r.mtu, r.family, r.next_hop, r.period)
        };
        let next_hop = |addr: IpAddr| match addr {
            IpAddr::V4(a) => [u32::from_ne_bytes(a.octets()), 0, 0, 0],
            IpAddr::V6(a) => {
                let o = a.octets();
                std::array::from_fn(|i| u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]]))
            }
        };
        // The IPv6 pods (`forwarding_node` routes the IPv4 ones).
        ip(&["-6", "route", "add", "fd00:10:244::/48", "dev", "out0"]);
        let mut sport = 40050;
        for (client, node, cluster_ip, pod, prefixes, family) in families {
            // The client is routed too: the backend's answer goes straight out, as the SYN did.
            ip(&[family, "route", "add", prefixes[1], "dev", "out0"]);
            let prefixes = prefixes.map(|p| {
                let (addr, len) = p.split_once('/').unwrap();
                (addr.parse::<IpAddr>().unwrap(), len.parse::<u8>().unwrap())
            });
            let af = if client.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 } as u8;
            // The NodePort (masqueraded: the masquerade address's lookup is kept) and the
            // ClusterIP (not masqueraded from this client: the forwarding lookup is kept).
            for (frontend, port, masqueraded) in [(node, 30080, true), (cluster_ip, 80, false)] {
                // Each attempt starts early in a period of the clock, as above, and one whose
                // packets did not all fall in it starts over on a new tuple; only the packets
                // and the route changes are in that window (no process, no table walk), so an
                // attempt fits a period even under an emulated CPU, and the test waits for one
                // that does rather than counting on the first few.
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
                let (period, client_key, backend_key, verdicts) = loop {
                    let period = early_in_a_route_period();
                    sport += 1;
                    let syn = tcp(client, sport, frontend, port);
                    let (verdict, out) = rig.ingress(&syn.bytes());
                    assert_eq!(verdict, TC_ACT_REDIRECT, "{frontend}");
                    // The backend answers the address and port it saw.
                    let (seen, seen_port) = (if masqueraded { node } else { client }, sport_of(&out));
                    let answer = Pkt { tcp_flags: TCP_SYN | TCP_ACK, ..tcp(pod, 8080, seen, seen_port) };
                    assert_eq!(rig.ingress(&answer.bytes()).0, TC_ACT_REDIRECT, "the answer, straight out");
                    // Established now; each entry keeps the route its direction's first packet
                    // took. Both routes gone: the client's ACK and the backend's first data go
                    // by the kept routes, with no lookup of their own (which would find none:
                    // the host stack's).
                    routes(false, prefixes);
                    let ack = Pkt { tcp_flags: TCP_ACK, seq: 1001, ack: 7001, ..syn };
                    let data = Pkt { tcp_flags: TCP_PSH | TCP_ACK, seq: 7001, ack: 1001, ..answer };
                    let verdicts = (rig.ingress(&ack.bytes()).0, rig.ingress(&data.bytes()).0);
                    let in_period = period_now() == period;
                    routes(true, prefixes);
                    let client_key = CtKey::new(client.into(), frontend.into(), sport.to_be(), port.to_be(), 6);
                    let backend_key = CtKey::new(pod.into(), seen.into(), 8080u16.to_be(), seen_port.to_be(), 6);
                    if in_period {
                        break (period, client_key, backend_key, verdicts);
                    }
                    assert!(std::time::Instant::now() < deadline, "no attempt fit a route period in 120 s");
                };
                // What the entries keep (read now: packets sent by a kept route within its
                // period leave it as it is).
                let kept_now = (kept(&client_key), kept(&backend_key));
                if cached {
                    assert_eq!(kept_now.0, (out0, 1500, af, next_hop(pod), period), "the SYN's");
                    assert_eq!(kept_now.1, (out0, 1500, af, next_hop(client), period), "the answer's");
                } else {
                    assert_eq!(kept_now, ((0, 0, 0, [0; 4], 0), (0, 0, 0, [0; 4], 0)));
                }
                let expected = if cached { TC_ACT_REDIRECT } else { TC_ACT_OK };
                assert_eq!(verdicts, (expected, expected), "{frontend}");
            }
        }
    })
    .unwrap();
}

/// `churn_services` with sessionAffinity ClientIP (`timeout` seconds), and the TCP NodePort's
/// service port also on CLUSTER_IP:90 from outside.
fn affinity_services(timeout: u32) -> Desired {
    let mut d = churn_services();
    let node_port = frontend_key(Ipv4Addr::UNSPECIFIED, 30090, Protocol::Tcp, SCOPE_EXTERNAL);
    let mut cluster_ip = d[&node_port].clone();
    cluster_ip.flags = 0;
    d.insert(frontend_key(CLUSTER_IP, 90, Protocol::Tcp, SCOPE_EXTERNAL), cluster_ip);
    for port in d.values_mut() {
        port.affinity_timeout = timeout;
    }
    d
}

/// The backends `client`'s SYNs from ports `sports` to the TCP NodePort go to.
fn syn_backends(rig: &Rig, client: Ipv4Addr, sports: std::ops::Range<u16>) -> std::collections::BTreeSet<Ipv4Addr> {
    sports
        .map(|sport| {
            let (verdict, out) = rig.ingress(&tcp(client, sport, NODE_IP, 30090).bytes());
            assert_eq!(verdict, TC_ACT_OK);
            dst_of(&out)
        })
        .collect()
}

#[test]
fn session_affinity_keeps_a_client_on_its_endpoint_until_it_leaves_or_times_out() {
    use std::collections::BTreeSet;
    // Without affinity, one client's new connections spread over the four endpoints.
    let rig = Rig::new(&affinity_services(0));
    assert!(syn_backends(&rig, CLIENT, 41000..41016).len() > 1);

    let mut rig = Rig::new(&affinity_services(1));
    let first = syn_backends(&rig, CLIENT, 41000..41016);
    assert_eq!(first.len(), 1, "one client, one endpoint: {first:?}");
    let other_client = Ipv4Addr::new(10, 0, 0, 98);
    assert_eq!(syn_backends(&rig, other_client, 41000..41016).len(), 1, "every client has its own");
    // The same service port through its ClusterIP: the same endpoint.
    for sport in 41100..41108 {
        let (verdict, out) = rig.ingress(&tcp(CLIENT, sport, CLUSTER_IP, 90).bytes());
        assert_eq!((verdict, dst_of(&out)), (TC_ACT_OK, *first.iter().next().unwrap()), "via the ClusterIP");
    }

    // Its endpoint leaves: the client is balanced anew, and keeps the new one.
    let gone = *first.iter().next().unwrap();
    let mut d = affinity_services(1);
    for port in d.values_mut() {
        port.backends.retain(|(ip, _)| *ip != gone);
    }
    rig.reprogram(&d);
    let after = syn_backends(&rig, CLIENT, 42000..42016);
    assert_eq!(after.len(), 1, "{after:?}");
    assert!(!after.contains(&gone), "not the endpoint that left");

    // A client idle for longer than the timeout is balanced anew: over rounds, it lands on
    // more than one endpoint (all in one after 16 rounds with three endpoints left: (1/3)^15;
    // the rounds stop at the second endpoint).
    let mut seen = BTreeSet::new();
    for round in 0..16u16 {
        std::thread::sleep(std::time::Duration::from_millis(1100));
        seen.extend(syn_backends(&rig, CLIENT, 43000 + 10 * round..43001 + 10 * round));
        if seen.len() > 1 {
            break;
        }
    }
    assert!(seen.len() > 1, "the affinity never timed out: {seen:?}");
}

/// Pinned maps keep the size they were made with: an agent started on them with other
/// `--max-*` values (its flags, or a new default after an upgrade) loads on them instead of
/// refusing to start, and knows their real capacity (a service port past it is refused as not
/// fitting, and logged once).
#[test]
fn an_agent_with_other_map_sizes_serves_on_the_pinned_maps() {
    let rig = Rig::new(&services());
    let mut cfg = DatapathConfig::new(rig.pins.0.clone(), "/nonexistent".into());
    cfg.max_service_ports = 4096;
    cfg.max_backends = 4096;
    let mut ebpf = bpf::open_object(&cfg).expect("the object loads on the pinned maps");
    let maps = BpfMaps::take_from(&mut ebpf).unwrap();
    assert_eq!(maps.capacity(), Capacity { service_ports: 64, backends: 64 }, "the sizes the rig made them with");
}

/// A connection kube-proxy translated before the takeover (its tuples in `KPR_HANDOVER`) is
/// left to netfilter both ways, untouched; a new connection reusing the client's tuple (a
/// SYN) is kpr's, and takes the tuple back.
#[test]
fn flows_handed_over_from_kube_proxy_pass_untouched_until_a_new_connection_reuses_the_tuple() {
    let rig = Rig::new(&services());
    let key = |src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16| {
        CtKey::new(src.into(), dst.into(), sport.to_be(), dport.to_be(), proxy_common::IPPROTO_TCP)
    };
    let original = key(CLIENT, 40100, CLUSTER_IP, 80);
    // Handed over as the agent does it: a tuple in the map is looked up only once counted.
    let mut takeover = kpr::takeover::Takeover::open(&rig.pins.0).unwrap();
    takeover.hand_over(&[original, key(POD, 8080, CLIENT, 40100)]);
    let map = aya::maps::MapData::from_pin(bpf::pin_dir(&rig.pins.0).join(proxy_common::map_names::HANDOVER)).unwrap();
    let handover: aya::maps::HashMap<_, CtKey, u8> =
        aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(map)).unwrap();

    let ack = Pkt { tcp_flags: TCP_ACK, seq: 1001, ack: 5000, ..tcp(CLIENT, 40100, CLUSTER_IP, 80) };
    assert_eq!(rig.ingress(&ack.bytes()), (TC_ACT_UNSPEC, ack.bytes()), "netfilter's to translate");
    let reply = Pkt { tcp_flags: TCP_ACK, seq: 5000, ack: 1001, ..tcp(POD, 8080, CLIENT, 40100) };
    assert_eq!(rig.ingress(&reply.bytes()), (TC_ACT_UNSPEC, reply.bytes()), "the reply too");
    assert_eq!(rig.egress(&reply.bytes()), (TC_ACT_UNSPEC, reply.bytes()));
    assert!(rig.flows().is_empty(), "no flow of kpr's");

    let syn = tcp(CLIENT, 40100, CLUSTER_IP, 80);
    let (verdict, out) = rig.ingress(&syn.bytes());
    assert_eq!(
        (verdict, out),
        (TC_ACT_OK, Pkt { dst: POD.into(), dport: 8080, ..syn }.bytes()),
        "a new connection is kpr's"
    );
    assert!(handover.get(&original, 0).is_err(), "the tuple is kpr's from then on");
    assert_eq!(rig.counter(counter::TC_NEW_FLOW), 1);
}

// ---------- IPv6 ----------

/// UDP over IPv6, its checksum (mandatory in IPv6) fixed for the new addresses.
#[test]
fn ipv6_udp_is_translated_both_ways_with_exact_checksums() {
    let rig = Rig::new(&services());
    let query = udp(CLIENT6, 40201, CLUSTER_IP6, 53);
    assert_eq!(rig.ingress(&query.bytes()), (TC_ACT_OK, Pkt { dst: POD6.into(), dport: 5353, ..query }.bytes()));
    let answer = udp(POD6, 5353, CLIENT6, 40201);
    assert_eq!(rig.egress(&answer.bytes()).1, Pkt { src: CLUSTER_IP6.into(), sport: 53, ..answer }.bytes());
}

#[test]
fn ipv6_node_port_is_masqueraded_to_the_node_ipv6_address() {
    let rig = Rig::new(&services());
    let syn = tcp(CLIENT6, 40210, NODE_IP6, 30080);
    let (verdict, out) = rig.ingress(&syn.bytes());
    assert_eq!(verdict, TC_ACT_OK);
    let nat_port = sport_of(&out);
    assert_ne!(nat_port, 40210, "the client's port is translated too");
    assert_eq!(out, Pkt { src: NODE_IP6.into(), sport: nat_port, dst: POD6.into(), dport: 8080, ..syn }.bytes());
    // The reply comes back to the node's address and leaves as the NodePort's.
    let reply = Pkt { tcp_flags: TCP_SYN | TCP_ACK, seq: 5000, ack: 1001, ..tcp(POD6, 8080, NODE_IP6, nat_port) };
    let (verdict, out) = rig.ingress(&reply.bytes());
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(out, Pkt { src: NODE_IP6.into(), sport: 30080, dst: CLIENT6.into(), dport: 40210, ..reply }.bytes());
    // An IPv4-only NodePort is no IPv6 one: 30081 is not programmed for IPv6.
    let other = tcp(CLIENT6, 40211, NODE_IP6, 30081);
    assert_eq!(rig.ingress(&other.bytes()), (TC_ACT_UNSPEC, other.bytes()));
}

#[test]
fn ipv6_without_endpoints_tcp_gets_a_reset_and_udp_icmpv6_port_unreachable() {
    let rig = Rig::new(&services());
    assert_reset(&rig, CLIENT6, 40220, CLUSTER_IP6, 81);

    let datagram = udp(CLIENT6, 40221, CLUSTER_IP6, 54);
    let input = datagram.bytes_with_macs([1; 6], [2; 6]);
    let (verdict, out) = rig.ingress(&input);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    // ICMPv6 destination unreachable, port unreachable (1/4), quoting the IPv6 header and the
    // datagram's first 8 bytes; its checksum covers the pseudo header.
    let mut icmp = vec![1, 4, 0, 0, 0, 0, 0, 0];
    icmp.extend_from_slice(&input[14..14 + 48]);
    let c = l4_csum(CLUSTER_IP6.into(), CLIENT6.into(), 58, &icmp);
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    assert_eq!(out, frame6(([2; 6], [1; 6]), CLUSTER_IP6, CLIENT6, 58, &icmp));
}

/// Extension headers are not walked: a packet with one passes untouched (and is counted),
/// never mangled.
#[test]
fn ipv6_packets_with_extension_headers_pass_untouched() {
    let rig = Rig::new(&services());
    let plain = tcp(CLIENT6, 40230, CLUSTER_IP6, 80).bytes();
    // A hop-by-hop options header (next header: TCP; PadN to 8 bytes) before the TCP header.
    let mut l4 = vec![6, 0, 1, 4, 0, 0, 0, 0];
    l4.extend_from_slice(&plain[54..]);
    let with_header = frame6(MACS, CLIENT6, CLUSTER_IP6, 0, &l4);
    let before = rig.counter(counter::TC_PASSED_UNSUPPORTED);
    assert_eq!(rig.ingress(&with_header), (TC_ACT_UNSPEC, with_header.clone()));
    assert_eq!(rig.counter(counter::TC_PASSED_UNSUPPORTED), before + 1);
}

/// An ICMPv6 error quoting `quoted` (its first 48 bytes: IPv6 header + ports and more).
fn icmp6_error(src: Ipv6Addr, dst: Ipv6Addr, icmp_type: u8, rest: [u8; 4], quoted: &[u8]) -> Vec<u8> {
    let mut icmp = vec![icmp_type, 0, 0, 0];
    icmp.extend_from_slice(&rest);
    icmp.extend_from_slice(&quoted[..48]);
    let c = l4_csum(src.into(), dst.into(), 58, &icmp);
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    frame6(MACS, src, dst, 58, &icmp)
}

#[test]
fn ipv6_icmp_errors_about_a_translated_flow_are_translated_back() {
    let rig = Rig::new(&services());
    let syn = tcp(CLIENT6, 40240, NODE_IP6, 30080);
    let out = rig.ingress(&syn.bytes()).1;
    let nat_port = sport_of(&out);
    // The backend says "packet too big, MTU 1400" about a packet it got from the node.
    let as_seen = Pkt { src: NODE_IP6.into(), sport: nat_port, dst: POD6.into(), dport: 8080, ..syn }.bytes();
    let error = icmp6_error(POD6, NODE_IP6, 2, 1400u32.to_be_bytes(), &as_seen[14..]);
    let (verdict, out) = rig.ingress(&error);
    assert_eq!(verdict, TC_ACT_OK);
    // The client gets it from the NodePort's address, quoting the packet as the client sent it.
    let expected = icmp6_error(NODE_IP6, CLIENT6, 2, 1400u32.to_be_bytes(), &syn.bytes()[14..]);
    assert_eq!(out, expected);
    // About an unknown flow: untouched.
    let stranger = icmp6_error(POD6, NODE_IP6, 1, [0; 4], &tcp(NODE_IP6, 1, POD6, 2).bytes()[14..]);
    assert_eq!(rig.ingress(&stranger).1, stranger);
}

/// Hairpin, traffic policy and source ranges in IPv6, as in IPv4: a pod reaching itself through
/// its ClusterIP is masqueraded to the node's IPv6 address; eTP=Local without a local endpoint
/// drops; a LoadBalancer IP admits only its IPv6 source range.
#[test]
fn ipv6_hairpin_traffic_policy_and_source_ranges() {
    let rig = Rig::new(&services());
    let syn = tcp(POD6, 40250, CLUSTER_IP6, 80);
    let out = rig.ingress(&syn.bytes()).1;
    let nat_port = sport_of(&out);
    assert_eq!(out, Pkt { src: NODE_IP6.into(), sport: nat_port, dst: POD6.into(), dport: 8080, ..syn }.bytes());

    let local = tcp(CLIENT6, 40251, NODE_IP6, 30085);
    assert_eq!(rig.ingress(&local.bytes()).0, TC_ACT_SHOT, "eTP=Local without local endpoints drops");

    let inside = tcp(CLIENT6, 40252, LB_IP6, 80);
    let (verdict, out) = rig.ingress(&inside.bytes());
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        out,
        Pkt { src: NODE_IP6.into(), sport: sport_of(&out), dst: POD6.into(), dport: 8080, ..inside }.bytes()
    );
    let outside = tcp(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x100), 40253, LB_IP6, 80);
    assert_eq!(rig.ingress(&outside.bytes()).0, TC_ACT_SHOT, "fd00::100 is outside fd00::98/126");
    assert_eq!(rig.counter(counter::TC_DROPPED), 2);
}

const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;

/// `frame` with its TTL (IPv4, header checksum computed anew) or hop limit (IPv6) one less.
fn one_hop_older(frame: Vec<u8>) -> Vec<u8> {
    if frame[12..14] == [0x86, 0xdd] {
        let mut frame = frame;
        frame[21] -= 1;
        return frame;
    }
    let ttl = frame[22];
    with_ttl(frame, ttl - 1)
}

#[test]
fn xdp_sends_an_established_external_flows_packets_back_out_of_their_link_and_passes_the_rest() {
    const OUT0_MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];
    const POD_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0x22];
    const CLIENT_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0x99];
    // A node whose client and pods are both behind out0 (an endpoint on another node, behind
    // the link the NodePort's traffic comes in by), their neighbours known; side0 is another
    // link, where the pods' route can be moved.
    let ns = testbed::Netns::new(&testbed::unique_name("kt-xdp")).unwrap();
    ns.ip_batch([
        "link add out0 address 02:00:00:00:00:01 type veth peer name out1".to_owned(),
        "link add side0 type veth peer name side1".to_owned(),
        "link set out0 up".to_owned(),
        "link set out1 up".to_owned(),
        "link set side0 up".to_owned(),
        "link set side1 up".to_owned(),
        "route add 10.244.0.0/16 dev out0".to_owned(),
        "route add 10.0.0.0/24 dev out0".to_owned(),
        "route add fd00:10:244::/48 dev out0".to_owned(),
        "route add fd00::/64 dev out0".to_owned(),
        format!("neigh add {POD} lladdr 02:00:00:00:00:22 dev out0 nud permanent"),
        format!("neigh add {CLIENT} lladdr 02:00:00:00:00:99 dev out0 nud permanent"),
        format!("neigh add {POD6} lladdr 02:00:00:00:00:22 dev out0 nud permanent"),
        format!("neigh add {CLIENT6} lladdr 02:00:00:00:00:99 dev out0 nud permanent"),
        format!("neigh add {POD} lladdr 02:00:00:00:00:23 dev side0 nud permanent"),
    ])
    .unwrap();
    ns.sh("echo 1 > /proc/sys/net/ipv4/ip_forward; echo 1 > /proc/sys/net/ipv6/conf/all/forwarding").unwrap();
    ns.run(|| {
        let out0 = unsafe { libc::if_nametoindex(c"out0".as_ptr()) };
        let mut d = services();
        entry(&mut d, Ipv4Addr::UNSPECIFIED, 30053, Protocol::Udp, SCOPE_EXTERNAL, &[(POD, 5353)], SERVICE_FLAG_SNAT);
        let rig = Rig::with(&d, |cfg| {
            cfg.forward_direct = bpf::ForwardDirect::Always;
            cfg.xdp = bpf::XdpSetting::Native;
        });
        let mut sent = 0;
        // A NodePort flow of each family set up through tc: SYN, the pod's answer, the ACK.
        for (client, node, pod, sport) in [
            (IpAddr::from(CLIENT), IpAddr::from(NODE_IP), IpAddr::from(POD), 40100),
            (CLIENT6.into(), NODE_IP6.into(), POD6.into(), 40101),
        ] {
            let syn = tcp(client, sport, node, 30080);
            let (verdict, out) = rig.ingress(&syn.bytes());
            assert_eq!(verdict, TC_ACT_REDIRECT, "{client}: the SYN");
            let nat_port = sport_of(&out);
            let answer = Pkt { tcp_flags: TCP_SYN | TCP_ACK, ..tcp(pod, 8080, node, nat_port) };
            assert_eq!(rig.ingress(&answer.bytes()).0, TC_ACT_REDIRECT, "{client}: the answer");
            let ack = Pkt { tcp_flags: TCP_ACK, seq: 1001, ack: 7001, ..syn };
            assert_eq!(rig.ingress(&ack.bytes()).0, TC_ACT_REDIRECT, "{client}: the ACK");

            // The client's next segments: translated, one hop older, to the pod's MAC from
            // out0's, and sent back out (checksums computed from scratch here).
            let data = Pkt { tcp_flags: TCP_ACK | TCP_PSH, ..ack };
            let expected = Pkt { src: node, sport: nat_port, dst: pod, dport: 8080, ..data };
            for _ in 0..3 {
                let (action, out) = rig.xdp(&data.bytes(), out0);
                assert_eq!(action, XDP_TX, "{client}: an established segment");
                assert_eq!(out, one_hop_older(expected.bytes_with_macs(POD_MAC, OUT0_MAC)), "{client}");
                sent += 1;
            }
            // The pod's: translated back to the NodePort, toward the client.
            let reply = Pkt { tcp_flags: TCP_ACK | TCP_PSH, seq: 7001, ack: 1006, ..tcp(pod, 8080, node, nat_port) };
            let (action, out) = rig.xdp(&reply.bytes(), out0);
            assert_eq!(action, XDP_TX, "{client}: the reply");
            let back = Pkt { src: node, sport: 30080, dst: client, dport: sport, ..reply };
            assert_eq!(out, one_hop_older(back.bytes_with_macs(CLIENT_MAC, OUT0_MAC)), "{client}: the reply");
            sent += 1;

            // What changes the flow's state (SYN, FIN, RST), an unknown tuple, a TTL about to
            // run out: passed untouched, for tc.
            for (what, packet) in [
                ("a FIN", Pkt { tcp_flags: TCP_FIN | TCP_ACK, ..data }.bytes()),
                ("a RST", Pkt { tcp_flags: TCP_RST, ..data }.bytes()),
                ("a SYN", syn.bytes()),
                ("another tuple", Pkt { sport: sport + 100, ..data }.bytes()),
            ] {
                assert_eq!(rig.xdp(&packet, out0), (XDP_PASS, packet.clone()), "{client}: {what}");
            }
            if client.is_ipv4() {
                let dying = with_ttl(data.bytes(), 1);
                assert_eq!(rig.xdp(&dying, out0), (XDP_PASS, dying.clone()), "TTL 1");
            }
        }
        assert_eq!(rig.counter(counter::XDP_FORWARDED), sent);

        // UDP: established by the pod's answer; a zero (absent) checksum stays zero.
        let first = udp(CLIENT, 40200, NODE_IP, 30053);
        let (verdict, out) = rig.ingress(&first.bytes());
        assert_eq!(verdict, TC_ACT_REDIRECT);
        let nat_port = sport_of(&out);
        assert_eq!(rig.ingress(&udp(POD, 5353, NODE_IP, nat_port).bytes()).0, TC_ACT_REDIRECT);
        for zero_csum in [false, true] {
            let datagram = Pkt { zero_csum, ..first };
            let (action, out) = rig.xdp(&datagram.bytes(), out0);
            assert_eq!(action, XDP_TX, "UDP, zero checksum: {zero_csum}");
            let expected = Pkt { src: NODE_IP.into(), sport: nat_port, dst: POD.into(), dport: 5353, ..datagram };
            assert_eq!(out, one_hop_older(expected.bytes_with_macs(POD_MAC, OUT0_MAC)), "zero checksum: {zero_csum}");
            sent += 1;
        }

        let data = Pkt { tcp_flags: TCP_ACK | TCP_PSH, seq: 1001, ack: 7001, ..tcp(CLIENT, 40100, NODE_IP, 30080) };
        let key = CtKey4::new(CLIENT.into(), NODE_IP.into(), 40100u16.to_be(), 30080u16.to_be(), 6);
        let mut table = rig.table4(proxy_common::map_names::CONNTRACK4);
        let entry = table.get(&key, 0).unwrap();
        let passed = |why: &str| {
            assert_eq!(rig.xdp(&data.bytes(), out0), (XDP_PASS, data.bytes()), "{why}");
        };
        // Something filters forwarded packets on the host (a NetworkPolicy in FORWARD): XDP
        // passes everything to tc, which takes the host's path.
        let mut host = bpf::HostState::open(&rig.pins.0).unwrap();
        host.set_forward_direct(false).unwrap();
        passed("the host filters forwarded packets");
        host.set_forward_direct(true).unwrap();
        assert_eq!(rig.xdp(&data.bytes(), out0).0, XDP_TX);
        sent += 1;
        // An entry due for its refresh is tc's, which refreshes it; then XDP's again.
        let mut aged = entry;
        aged.last_seen -= 2 * ct::REFRESH_NS;
        table.insert(&key, &aged, 0).unwrap();
        rig.conntrack().changed().unwrap();
        passed("an entry due for its refresh");
        assert_eq!(rig.ingress(&data.bytes()).0, TC_ACT_REDIRECT);
        assert_eq!(rig.xdp(&data.bytes(), out0).0, XDP_TX, "refreshed by tc");
        sent += 1;
        // The endpoint's side of a direct server return flow (its replies leave by a pod's link).
        let dsr_reply = ct::DSR | ct::REPLY;
        table.insert(&key, &CtValue { flags: entry.flags | dsr_reply, ..table.get(&key, 0).unwrap() }, 0).unwrap();
        rig.conntrack().changed().unwrap();
        passed("the endpoint's side of a direct server return flow");
        table.insert(&key, &entry, 0).unwrap();
        rig.conntrack().changed().unwrap();
        // The pods' route moves to side0: the translated packet would leave by another link.
        // XDP keeps a route for the rest of its period (as tc's kept routes): from the next
        // one on (and a tick of the coarse clock), the packet is tc's.
        testbed::ip(&["route", "replace", "10.244.0.0/16", "dev", "side0"]).unwrap();
        let period = period_now();
        while period_now() == period {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        std::thread::sleep(std::time::Duration::from_millis(30));
        passed("the route leaves by another link");
        assert_eq!(rig.counter(counter::XDP_FORWARDED), sent);
    })
    .unwrap();
}

/// Direct server return at the entry node: once the flow is open (tc put its SYN in the
/// tunnel), XDP puts the client's next segments in the tunnel itself, byte for byte as tc's
/// direct path does (the outer header to the endpoint from the node, its TTL one less; the
/// inner packet as it came), and sends them back out of their link; one too big for the link
/// once tunnelled is tc's ("fragmentation needed").
#[test]
fn xdp_puts_a_direct_server_return_flow_in_its_tunnel_as_tc_does() {
    const OUT0_MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];
    const POD_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0x22];
    let ns = testbed::Netns::new(&testbed::unique_name("kt-xdsr")).unwrap();
    ns.ip_batch([
        "link add out0 address 02:00:00:00:00:01 type veth peer name out1".to_owned(),
        "link set out0 up".to_owned(),
        "link set out1 up".to_owned(),
        "route add 10.244.0.0/16 dev out0".to_owned(),
        "route add 10.0.0.0/24 dev out0".to_owned(),
        format!("neigh add {POD} lladdr 02:00:00:00:00:22 dev out0 nud permanent"),
        format!("neigh add {CLIENT} lladdr 02:00:00:00:00:99 dev out0 nud permanent"),
    ])
    .unwrap();
    ns.sh("echo 1 > /proc/sys/net/ipv4/ip_forward").unwrap();
    ns.run(|| {
        let out0 = unsafe { libc::if_nametoindex(c"out0".as_ptr()) };
        let mut d = services();
        entry(&mut d, Ipv4Addr::UNSPECIFIED, 30091, Protocol::Tcp, SCOPE_EXTERNAL, &[(POD, 8080)], SERVICE_FLAG_DSR);
        // The endpoint is on another node.
        d.get_mut(&frontend_key(Ipv4Addr::UNSPECIFIED, 30091, Protocol::Tcp, SCOPE_EXTERNAL)).unwrap().remote =
            vec![POD.into()];
        let rig = Rig::with(&d, |cfg| {
            cfg.forward_direct = bpf::ForwardDirect::Always;
            cfg.xdp = bpf::XdpSetting::Native;
        });
        let syn = tcp(CLIENT, 40300, NODE_IP, 30091);
        let (verdict, out) = rig.ingress(&syn.bytes());
        assert_eq!((verdict, out[23]), (TC_ACT_REDIRECT, 4), "the SYN in IP-in-IP");
        // The client's ACK of the endpoint's answer (which this node never sees).
        let ack = Pkt { tcp_flags: TCP_ACK, seq: 1001, ack: 7001, ..syn };
        let (verdict, by_tc) = rig.ingress(&ack.bytes());
        assert_eq!(verdict, TC_ACT_REDIRECT);
        let (action, by_xdp) = rig.xdp(&ack.bytes(), out0);
        assert_eq!(action, XDP_TX, "the next segment, put in the tunnel by XDP");
        assert_eq!(by_xdp[..14], [&POD_MAC[..], &OUT0_MAC[..], &[0x08, 0x00]].concat()[..], "to the endpoint's MAC");
        assert_eq!(by_xdp[14..], by_tc[14..], "the same outer header and inner packet as tc's");
        // The outer header, as built here from scratch: node → endpoint, IP-in-IP, the
        // endpoint's port as its id, don't fragment, TTL 63 after the hop.
        let inner = &ack.bytes()[14..];
        let outer =
            frame((POD_MAC, OUT0_MAC), Ip { src: NODE_IP, dst: POD, proto: 4, tos: 0, id: 8080, frags: 0x4000 }, inner);
        assert_eq!(by_xdp, with_id_ttl(outer, 8080, 63));
        assert_eq!(rig.counter(counter::XDP_FORWARDED), 1);
        // Too big for out0 once in the tunnel (1,500 bytes of IP before): tc's.
        let mut full = ack.bytes();
        full.resize(14 + 1500, 0);
        full[16..18].copy_from_slice(&1500u16.to_be_bytes());
        full[24..26].copy_from_slice(&[0, 0]);
        let c = csum(&full[14..34], 0);
        full[24..26].copy_from_slice(&c.to_be_bytes());
        assert_eq!(rig.xdp(&full, out0), (XDP_PASS, full.clone()), "too big for the tunnel");
        assert_eq!(rig.counter(counter::XDP_FORWARDED), 1);
    })
    .unwrap();
}
