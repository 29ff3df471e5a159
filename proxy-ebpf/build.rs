//! Rebuild the eBPF object when the bpf-linker binary changes (a new LLVM pairs with a new linker).
fn main() {
    if let Ok(linker) = which::which("bpf-linker") {
        println!("cargo:rerun-if-changed={}", linker.display());
    }
}
