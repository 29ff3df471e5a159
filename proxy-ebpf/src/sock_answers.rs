//! The socket path's part in outlier detection: how the endpoint a TCP `connect()` was
//! translated to answers its SYN, counted in `KPR_BACKEND_ANSWERS` as the per-packet path
//! counts a new flow's first answer. A `sock_ops` program on the hooks' cgroup; it counts only
//! the sockets the connect hooks translated (their `KPR_SOCK_TCP` entry says so), and only
//! while the agent asks for answers (`KPR_ANSWERS_WANTED`).
use aya_ebpf::{
    bindings::{
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_RTO_CB, BPF_SOCK_OPS_RTO_CB_FLAG, BPF_SOCK_OPS_STATE_CB,
        BPF_SOCK_OPS_STATE_CB_FLAG, BPF_SOCK_OPS_TCP_CONNECT_CB, BPF_TCP_CLOSE, BPF_TCP_SYN_SENT,
    },
    helpers::bpf_get_socket_cookie,
    macros::sock_ops,
    programs::SockOpsContext,
};
use proxy_common::{Addr, IPPROTO_TCP, SockTcp, sock_answer};

/// `AF_INET6`, as `bpf_sock_ops.family` holds it.
const AF_INET6: u32 = 10;

use crate::{
    maps::{ANSWERS_WANTED, SOCK_TCP},
    stats::{self, Answer},
};

/// What a `sock_ops` program returns to let the kernel go on (its reply left as it is).
const CONTINUE: u32 = 1;
/// The callbacks a waiting socket needs: its retransmission timeouts and its state changes.
/// Never cleared: another program on the cgroups may rely on them too (they stay for the
/// connection's life, each then a lookup that finds the count done).
const WAIT_FLAGS: u32 = BPF_SOCK_OPS_RTO_CB_FLAG | BPF_SOCK_OPS_STATE_CB_FLAG;

/// | callback | the socket | counted |
/// |---|---|---|
/// | `TCP_CONNECT_CB` | its SYN is about to go to its entry's endpoint | nothing; asks for the two below |
/// | `ACTIVE_ESTABLISHED_CB` | a SYN-ACK came | answered |
/// | `RTO_CB` in `SYN_SENT` | its SYN's first retransmission (1 s) | unanswered |
/// | `STATE_CB` `SYN_SENT` → `CLOSE`, before that | a RST (a segment came) | refused |
///
/// A connect that ends otherwise within the second (the client gave up or shut it, a local
/// error) is no failure of the endpoint's: the per-packet path's unanswered flows get the same
/// grace.
#[sock_ops]
pub fn kpr_sock_ops(ctx: SockOpsContext) -> u32 {
    let op = ctx.op();
    if !matches!(
        op,
        BPF_SOCK_OPS_TCP_CONNECT_CB | BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB | BPF_SOCK_OPS_RTO_CB | BPF_SOCK_OPS_STATE_CB
    ) {
        return CONTINUE;
    }
    // SAFETY: a sock_ops context is what the helper takes.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.ops.cast()) };
    let Some(entry) = SOCK_TCP.get_ptr_mut(&cookie) else { return CONTINUE };
    // SAFETY: a map value of this run.
    let entry = unsafe { &mut *entry };
    let waiting = entry.answer == sock_answer::WAITING;
    let late = entry.answer == sock_answer::LATE;
    let answer = match op {
        BPF_SOCK_OPS_TCP_CONNECT_CB => {
            if entry.answer != sock_answer::NONE {
                wait(&ctx, entry);
            }
            return CONTINUE;
        }
        BPF_SOCK_OPS_RTO_CB if waiting && state(&ctx) == BPF_TCP_SYN_SENT => {
            entry.answer = sock_answer::LATE;
            Answer::Unanswered
        }
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB if waiting || late => {
            entry.answer = sock_answer::DONE;
            Answer::Answered
        }
        BPF_SOCK_OPS_STATE_CB if (waiting || late) && ctx.arg(0) == BPF_TCP_SYN_SENT && ctx.arg(1) == BPF_TCP_CLOSE => {
            entry.answer = sock_answer::DONE;
            // SAFETY: a full socket's context (state callbacks have one).
            if late || unsafe { (*ctx.ops).segs_in } == 0 {
                return CONTINUE;
            }
            Answer::Refused
        }
        _ => return CONTINUE,
    };
    stats::backend_answered(&entry.backend, entry.backend_port, IPPROTO_TCP, answer);
    CONTINUE
}

/// A connect about to send its SYN: counted if it goes to the endpoint its entry names (not
/// after a connect that failed before its SYN, then retried elsewhere, untranslated), while
/// the agent reads answers. A retry to the same endpoint is counted anew.
#[inline(always)]
fn wait(ctx: &SockOpsContext, entry: &mut SockTcp) {
    let wanted = ANSWERS_WANTED.get(0).is_some_and(|w| *w != 0);
    if wanted && goes_to(ctx, entry) && ctx.set_cb_flags((ctx.cb_flags() | WAIT_FLAGS) as i32).is_ok() {
        entry.answer = sock_answer::WAITING;
    } else {
        entry.answer = sock_answer::NONE;
    }
}

/// The socket's peer is the entry's endpoint.
#[inline(always)]
fn goes_to(ctx: &SockOpsContext, entry: &SockTcp) -> bool {
    // The peer's port in network byte order, in the field's upper half (its ABI since 4.x on
    // little-endian machines) or, should a kernel change that, its lower one.
    let ops = ctx.ops;
    // SAFETY: the kernel's context; each field read as the 32-bit load it allows.
    let port = unsafe { core::ptr::read_volatile(&raw const (*ops).remote_port) };
    if (port >> 16) as u16 != entry.backend_port && port as u16 != entry.backend_port {
        return false;
    }
    // SAFETY: as above.
    let peer = unsafe {
        if core::ptr::read_volatile(&raw const (*ops).family) == AF_INET6 {
            let ip6 = (&raw const (*ops).remote_ip6).cast::<u32>();
            Addr([
                core::ptr::read_volatile(ip6),
                core::ptr::read_volatile(ip6.add(1)),
                core::ptr::read_volatile(ip6.add(2)),
                core::ptr::read_volatile(ip6.add(3)),
            ])
        } else {
            Addr::from_v4(core::ptr::read_volatile(&raw const (*ops).remote_ip4))
        }
    };
    peer == entry.backend
}

/// The socket's TCP state.
#[inline(always)]
fn state(ctx: &SockOpsContext) -> u32 {
    // SAFETY: the kernel's context for this program.
    unsafe { (*ctx.ops).state }
}
