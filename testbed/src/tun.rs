//! A layer-3 tunnel between two network namespaces on any kernel: a TUN device in each (no
//! Ethernet header on its packets, as on WireGuard's or IP-in-IP's links), and a thread that
//! writes what one sends into the other. With TAP devices (Ethernet frames) the same is a VM's
//! link: the host side's TAP device, whose frames a hypervisor carries to the guest's NIC.
use std::{
    fs::File,
    io::{Read as _, Write as _},
    os::fd::AsRawFd as _,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
};

use anyhow::{Context as _, Result};

/// A TUN device's file: the device lives as long as it is open.
pub struct Tun(File);

impl Tun {
    /// Create TUN device `name` in the calling thread's network namespace (IP packets, no
    /// packet information header).
    pub fn open(name: &str) -> Result<Self> {
        Self::open_as(name, libc::IFF_TUN)
    }

    /// Create TAP device `name` (Ethernet frames), as a hypervisor's.
    pub fn open_tap(name: &str) -> Result<Self> {
        Self::open_as(name, libc::IFF_TAP)
    }

    fn open_as(name: &str, kind: libc::c_int) -> Result<Self> {
        // `Ioctl`: the request's type differs between libcs (glibc and musl).
        const TUNSETIFF: libc::Ioctl = 0x4004_54ca as libc::Ioctl;
        let file = File::options().read(true).write(true).open("/dev/net/tun").context("/dev/net/tun")?;
        // struct ifreq: the name, then the flags.
        let mut ifreq = [0u8; 40];
        anyhow::ensure!(name.len() < libc::IF_NAMESIZE, "name too long: {name}");
        ifreq[..name.len()].copy_from_slice(name.as_bytes());
        let flags = (kind | libc::IFF_NO_PI) as u16;
        ifreq[16..18].copy_from_slice(&flags.to_ne_bytes());
        // SAFETY: TUNSETIFF reads and writes a struct ifreq, 40 bytes.
        if unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, ifreq.as_mut_ptr()) } != 0 {
            return Err(std::io::Error::last_os_error()).with_context(|| format!("creating TUN/TAP device {name}"));
        }
        Ok(Self(file))
    }

    /// Carry packets between two TUN devices, both ways, until the returned wire is dropped.
    pub fn join(a: Tun, b: Tun) -> Wire {
        let stop = Arc::new(AtomicBool::new(false));
        let carry = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut ends = [a.0, b.0];
                let mut buf = vec![0u8; 65536];
                while !stop.load(Ordering::Relaxed) {
                    let mut fds =
                        ends.each_ref().map(|f| libc::pollfd { fd: f.as_raw_fd(), events: libc::POLLIN, revents: 0 });
                    // SAFETY: two pollfds, 100 ms at most.
                    if unsafe { libc::poll(fds.as_mut_ptr(), 2, 100) } <= 0 {
                        continue;
                    }
                    for (from, to) in [(0, 1), (1, 0)] {
                        if fds[from].revents & libc::POLLIN == 0 {
                            continue;
                        }
                        if let Ok(n) = ends[from].read(&mut buf) {
                            // A device that is down refuses it: the packet is lost, as on a wire.
                            let _ = ends[to].write(&buf[..n]);
                        }
                    }
                }
            })
        };
        Wire { stop, carry: Some(carry) }
    }
}

/// Two TUN devices joined ([`Tun::join`]); dropped, the thread stops and the devices go.
pub struct Wire {
    stop: Arc<AtomicBool>,
    carry: Option<JoinHandle<()>>,
}

impl Drop for Wire {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(carry) = self.carry.take() {
            let _ = carry.join();
        }
    }
}
