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
use proxy_common::{IPPROTO_TCP, SockTcp, sock_answer};

use crate::{
    maps::{ANSWERS_WANTED, SOCK_TCP},
    stats::{self, Answer},
};

/// What a `sock_ops` program returns to let the kernel go on (its reply left as it is).
const CONTINUE: u32 = 1;
/// The callbacks a waiting socket needs: its retransmission timeouts and its state changes.
const WAIT_FLAGS: u32 = BPF_SOCK_OPS_RTO_CB_FLAG | BPF_SOCK_OPS_STATE_CB_FLAG;

/// | callback | the socket | counted |
/// |---|---|---|
/// | `TCP_CONNECT_CB` | its SYN is about to go | nothing; asks for the two below |
/// | `ACTIVE_ESTABLISHED_CB` | a SYN-ACK came | answered |
/// | `RTO_CB` in `SYN_SENT` | its SYN's first retransmission (1 s) | unanswered |
/// | `STATE_CB` `SYN_SENT` → `CLOSE` | a RST (a segment came) | refused |
/// | the same, nothing received | an ICMP error, the retries ran out | unanswered, unless already |
///
/// A socket closed while its SYN waits (the client gave up) is counted unanswered by
/// `kpr_sock_release`, which runs before the close's state change and removes the entry.
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
            if waiting {
                wait(&ctx, entry);
            }
            return CONTINUE;
        }
        BPF_SOCK_OPS_RTO_CB if waiting && state(&ctx) == BPF_TCP_SYN_SENT => {
            entry.answer = sock_answer::LATE;
            Answer::Unanswered
        }
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB if waiting || late => {
            done(&ctx, entry);
            Answer::Answered
        }
        BPF_SOCK_OPS_STATE_CB if (waiting || late) && ctx.arg(0) == BPF_TCP_SYN_SENT && ctx.arg(1) == BPF_TCP_CLOSE => {
            done(&ctx, entry);
            if late {
                return CONTINUE;
            }
            // SAFETY: a full socket's context (state callbacks have one).
            if unsafe { (*ctx.ops).segs_in } > 0 { Answer::Refused } else { Answer::Unanswered }
        }
        _ => return CONTINUE,
    };
    stats::backend_answered(&entry.backend, entry.backend_port, IPPROTO_TCP, answer);
    CONTINUE
}

/// Ask for the waiting socket's timeouts and state changes while the agent reads answers;
/// else it is not counted.
#[inline(always)]
fn wait(ctx: &SockOpsContext, entry: &mut SockTcp) {
    let have = ctx.cb_flags();
    let wanted = ANSWERS_WANTED.get(0).is_some_and(|w| *w != 0);
    if wanted && ctx.set_cb_flags((have | WAIT_FLAGS) as i32).is_ok() {
        entry.cb_flags = (WAIT_FLAGS & !have) as u8;
    } else {
        entry.answer = sock_answer::NONE;
    }
}

/// Counted: the callbacks this program asked for go (not those another program set).
#[inline(always)]
fn done(ctx: &SockOpsContext, entry: &mut SockTcp) {
    entry.answer = sock_answer::DONE;
    let _ = ctx.set_cb_flags((ctx.cb_flags() & !u32::from(entry.cb_flags)) as i32);
}

/// The socket's TCP state.
#[inline(always)]
fn state(ctx: &SockOpsContext) -> u32 {
    // SAFETY: the kernel's context for this program.
    unsafe { (*ctx.ops).state }
}
