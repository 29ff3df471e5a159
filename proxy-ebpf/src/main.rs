//! kpr's eBPF programs.
//!
//! `sock_lb`: cgroup socket-address hooks that do socket-level service load balancing (the
//! connect-time equivalent of kube-proxy's KUBE-SVC/KUBE-SEP DNAT chains).
//! `tc`: tc programs on node interfaces that translate packets the socket hooks never see
//! (NodePort, externalIPs, LoadBalancer IPs, ClusterIP traffic from other namespaces), with
//! conntrack, reverse NAT and masquerade (kube-proxy's KUBE-NODEPORTS/KUBE-EXT/KUBE-MARK-MASQ).
//! `xdp`: in front of tc on the external links (`--xdp`), established flows sent back out of
//! the driver.
//! `sock_answers`: a `sock_ops` program counting how endpoints answer the socket path's TCP
//! connects, for outlier detection.
//! `flow_cache`: the per-CPU cache of established flows in front of `tc`'s conntrack.
//! `maps`: every map shared with the agent; `globals`: the settings the agent writes at load.
#![no_std]
#![no_main]
// `atomic_xadd` (`sock_lb::add`): the BPF target's atomic types lack read-modify-write.
#![feature(core_intrinsics)]
#![allow(internal_features)]

mod family;
mod flow_cache;
mod globals;
mod maps;
mod packet;
mod sock_answers;
mod sock_lb;
mod stats;
mod tc;
mod xdp;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any program that could reach a panic; this is never called.
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
