//! Socket-level load balancing: translate ClusterIP:port to a backend when a socket connects
//! (TCP, connected UDP) or sends (unconnected UDP), and translate back what the application
//! reads (getpeername, recvfrom), so it keeps seeing the ClusterIP as its peer.
use aya_ebpf::{
    EbpfContext as _, Global,
    helpers::{bpf_get_prandom_u32, bpf_get_socket_cookie, bpf_set_retval},
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
};
use aya_log_ebpf::error;
use proxy_common::{IPPROTO_TCP, IPPROTO_UDP, SCOPE_INTERNAL, ServiceKey, SockRevNatKey, SockRevNatValue, counter};

use crate::maps::{BACKENDS, SERVICES, SOCK_REVNAT, count};

/// Return value that lets the syscall proceed.
const ALLOW: i32 = 1;
/// Return value that fails the syscall (EPERM, or the errno set with `bpf_set_retval`).
const REJECT: i32 = 0;
const ECONNREFUSED: i32 = 111;

/// 1 when the kernel has `bpf_set_retval` for sock_addr hooks (5.18+). Set by the agent at load
/// time; on older kernels the helper call is dead code the verifier never sees, and a refused
/// connect surfaces as EPERM instead of ECONNREFUSED.
#[unsafe(no_mangle)]
static KPR_HAVE_SET_RETVAL: Global<u8> = Global::new(1);

#[cgroup_sock_addr(connect4)]
pub fn kpr_connect4(ctx: SockAddrContext) -> i32 {
    forward4(&ctx)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn kpr_sendmsg4(ctx: SockAddrContext) -> i32 {
    forward4(&ctx)
}

#[cgroup_sock_addr(recvmsg4)]
pub fn kpr_recvmsg4(ctx: SockAddrContext) -> i32 {
    reverse4(&ctx)
}

#[cgroup_sock_addr(getpeername4)]
pub fn kpr_getpeername4(ctx: SockAddrContext) -> i32 {
    reverse4(&ctx)
}

/// ClusterIP:port → random backend of that service port.
#[inline(always)]
fn forward4(ctx: &SockAddrContext) -> i32 {
    // SAFETY: the kernel hands every sock_addr program a valid context.
    let sa = unsafe { &mut *ctx.sock_addr };
    let proto = sa.protocol as u8;
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return ALLOW;
    }
    let key = ServiceKey { addr: sa.user_ip4, port: sa.user_port as u16, proto, scope: SCOPE_INTERNAL };
    // Not a service: one hash lookup and nothing else.
    let Some(service) = SERVICES.get_ptr(&key) else {
        return ALLOW;
    };
    // SAFETY: a pointer returned by the map lookup is valid for this program run.
    let service = unsafe { *service };

    if service.backends_count == 0 {
        // kube-proxy REJECTs a service port without endpoints.
        count(counter::NO_BACKENDS);
        if KPR_HAVE_SET_RETVAL.load() != 0 {
            unsafe { bpf_set_retval(-ECONNREFUSED) };
        }
        return REJECT;
    }

    let pick = unsafe { bpf_get_prandom_u32() } % service.backends_count;
    let slot = service.backends_start.wrapping_add(pick);
    let Some(backend) = BACKENDS.get(slot) else {
        count(counter::BAD_BACKEND_SLOT);
        error!(ctx, "kpr: service {} points at backend slot {} outside the array", service.service_id, slot);
        return ALLOW;
    };
    let backend = *backend;

    // Remember what the application asked for, so getpeername/recvmsg can show it.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let rev_key = SockRevNatKey { cookie, addr: backend.addr, port: backend.port, _pad: 0 };
    let rev_value = SockRevNatValue { addr: key.addr, port: key.port, _pad: 0, service_id: service.service_id };
    if SOCK_REVNAT.insert(&rev_key, &rev_value, 0).is_err() {
        count(counter::REVNAT_UPDATE_FAILED);
    }

    sa.user_ip4 = backend.addr;
    sa.user_port = u32::from(backend.port);
    count(counter::TRANSLATED);
    ALLOW
}

/// Backend address seen by the socket → the service address the application connected to.
#[inline(always)]
fn reverse4(ctx: &SockAddrContext) -> i32 {
    let sa = unsafe { &mut *ctx.sock_addr };
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let key = SockRevNatKey { cookie, addr: sa.user_ip4, port: sa.user_port as u16, _pad: 0 };
    if let Some(orig) = SOCK_REVNAT.get_ptr(&key) {
        let orig = unsafe { *orig };
        sa.user_ip4 = orig.addr;
        sa.user_port = u32::from(orig.port);
        count(counter::REVERSE_TRANSLATED);
    }
    ALLOW
}
