//! XDP in front of tc on the node's external links (`--xdp`): the program (`kpr_xdp`) loaded
//! with the tc programs, attached as a pinned bpf link per link (a restart swaps the new
//! program into it, as the TCX links), and detached where the plan no longer wants it.
use std::{collections::BTreeSet, path::Path};

use anyhow::{Context as _, Result};
use aya::{
    Ebpf,
    programs::{
        NetworkInterface, Xdp, XdpMode,
        links::{FdLink, PinnedLink},
        xdp::XdpLink,
    },
};
use proxy_common::program_names;

use super::pins::{link_pin, links_pinned, release_link};

/// Where the XDP program goes (`--xdp`), as Cilium's `loadBalancer.acceleration`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum XdpSetting {
    /// No XDP: tc does it all.
    #[default]
    Off,
    /// The driver's XDP on each external link; a link whose driver has none stays on tc (a
    /// warning says so).
    Native,
    /// The driver's XDP where it has one, else the kernel's generic XDP.
    BestEffort,
}

/// Load the XDP program (before the object's maps are taken out of it, as the tc programs).
pub fn load_program(ebpf: &mut Ebpf) -> Result<()> {
    let prog: &mut Xdp = ebpf
        .program_mut(program_names::XDP)
        .with_context(|| format!("program `{}` missing from the eBPF object", program_names::XDP))?
        .try_into()?;
    prog.load().with_context(|| format!("the verifier rejected `{}`", program_names::XDP))
}

/// Attach the program to link `ifindex` (or swap it into the link an earlier run pinned): the
/// mode it runs in ("native", "generic"; "kept" for a pinned link).
///
/// A veth's native XDP puts what it transmits (`XDP_TX`) in its peer's ring, which the kernel
/// drains at once only while the peer holds an XDP program of its own (else the frames wait
/// for the link's next ordinary packet, or are dropped where the peer has no NAPI). The peer is
/// in another namespace, out of the agent's sight: `best-effort` takes generic XDP on a veth
/// (transmitted as any packet), `native` the driver's, with a warning.
pub fn attach(ebpf: &mut Ebpf, dir: &Path, ifindex: u32, setting: XdpSetting, veth: bool) -> Result<&'static str> {
    let prog: &mut Xdp = ebpf.program_mut(program_names::XDP).context("no XDP program")?.try_into()?;
    let pin = link_pin(dir, program_names::XDP, ifindex);
    if pin.exists() {
        let link: FdLink =
            PinnedLink::from_pin(&pin).with_context(|| format!("failed to open pinned link {}", pin.display()))?.into();
        prog.attach_to_link(XdpLink::try_from(link)?).context("failed to update the pinned XDP link")?;
        return Ok("kept");
    }
    let modes: &[(XdpMode, &'static str)] = match setting {
        XdpSetting::Off => return Ok("off"),
        XdpSetting::Native => {
            if veth {
                tracing::warn!(
                    ifindex,
                    "native XDP on a veth: its peer must hold an XDP program, or the packets XDP sends back out \
                     wait or are dropped (--xdp best-effort takes generic XDP on a veth)"
                );
            }
            &[(XdpMode::Driver, "native")]
        }
        XdpSetting::BestEffort if veth => &[(XdpMode::Skb, "generic")],
        XdpSetting::BestEffort => &[(XdpMode::Driver, "native"), (XdpMode::Skb, "generic")],
    };
    let mut failure = None;
    for (mode, name) in modes {
        match prog.attach(NetworkInterface::Index(ifindex), *mode) {
            Ok(id) => {
                let link: FdLink = prog.take_link(id)?.try_into().context("an XDP bpf link")?;
                link.pin(&pin).with_context(|| format!("failed to pin {}", pin.display()))?;
                return Ok(name);
            }
            Err(e) => failure = Some(anyhow::Error::new(e).context(format!("{name} XDP"))),
        }
    }
    Err(failure.unwrap_or_else(|| anyhow::anyhow!("no XDP mode")))
}

/// Detach from link `ifindex`: its pinned link released.
pub fn detach(dir: &Path, ifindex: u32) {
    release_link(&link_pin(dir, program_names::XDP, ifindex));
}

/// Links that hold a pinned XDP link of this layout, by ifindex.
pub fn pinned(dir: &Path) -> BTreeSet<u32> {
    links_pinned(dir, program_names::XDP)
}
