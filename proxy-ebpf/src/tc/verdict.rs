//! What the stages tell each other: a tc verdict, or one of the values below.
use aya_ebpf::bindings::TC_ACT_UNSPEC;

/// "Not mine": the next program of the hook (TCX) or filter of the chain (cls_bpf) decides.
pub(super) const PASS: i32 = TC_ACT_UNSPEC;

// What the stages tell the next, besides a verdict: plain integers, not enums (an enum's
// unused payload is an uninitialized register, which the verifier refuses to see written).
/// `inspect`: a packet of a flow, its tuple filled in.
pub(super) const A_FLOW: i32 = i32::MIN;

/// `inspect`: an ICMP error, maybe about a translated flow.
pub(super) const AN_ICMP_ERROR: i32 = i32::MIN + 1;

/// `translate_tracked`: no live flow.
pub(super) const NO_FLOW: i32 = i32::MIN + 2;

/// `pick_backend_subprogram`: a new flow, of the service to the backend in the scratch area.
pub(super) const OPEN: i32 = i32::MIN + 3;

/// `pick_backend_subprogram`: a frontend without endpoints (kube-proxy's REJECT).
pub(super) const REJECT: i32 = i32::MIN + 4;

/// `forward_direct`: too big for the link its route leaves by; the lookup's answer (in the
/// scratch area) holds the link's MTU.
pub(super) const TOO_BIG: i32 = i32::MIN + 5;

/// `translate_tracked`: a packet of a flow whose endpoint died (`ct::ENDPOINT_DEAD`), which is
/// forgotten: the client is answered with a RST (`reject::reset_flow`).
pub(super) const END_FLOW: i32 = i32::MIN + 6;
