//! What the running kernel's BTF (`/sys/kernel/btf/vmlinux`) says that kpr's programs need
//! at load time: the id of a kfunc, and where a bit-field of `struct sk_buff` lies. Only the
//! few kinds of record needed to walk to them are read; the rest are skipped by their size.

use anyhow::{Context as _, Result, bail, ensure};

const MAGIC: u16 = 0xeb9f;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_FUNC: u32 = 12;

/// One type record: its kind, name, and (structs and unions) members as (name, type id, bit
/// offset) — a bit-field's offset unpacked from its `kind_flag` encoding.
struct Type {
    kind: u32,
    name: u32,
    members: Vec<(u32, u32, u32)>,
}

pub struct KernelBtf {
    strings: Vec<u8>,
    /// By type id, from 1 (id 0 is `void`).
    types: Vec<Type>,
}

impl KernelBtf {
    pub fn from_sys_fs() -> Result<Self> {
        let path = "/sys/kernel/btf/vmlinux";
        Self::parse(&std::fs::read(path).with_context(|| format!("failed to read {path}"))?)
    }

    pub fn parse(data: &[u8]) -> Result<Self> {
        let word = |at: usize| -> Result<u32> {
            Ok(u32::from_ne_bytes(data.get(at..at + 4).context("BTF cut short")?.try_into()?))
        };
        ensure!(
            data.len() >= 24 && u16::from_ne_bytes([data[0], data[1]]) == MAGIC,
            "not BTF (or not this CPU's byte order)"
        );
        let hdr_len = word(4)? as usize;
        let (type_off, type_len, str_off, str_len) = (word(8)?, word(12)?, word(16)?, word(20)?);
        let (types_at, types_end) = (hdr_len + type_off as usize, hdr_len + (type_off + type_len) as usize);
        let strings_at = hdr_len + str_off as usize;
        let strings = data.get(strings_at..strings_at + str_len as usize).context("BTF strings cut short")?.to_vec();
        let mut types = Vec::new();
        let mut at = types_at;
        while at < types_end {
            let (name, info) = (word(at)?, word(at + 4)?);
            let (kind, vlen, kind_flag) = ((info >> 24) & 0x1f, (info & 0xffff) as usize, info >> 31 == 1);
            at += 12;
            let mut members = Vec::new();
            let trailing = match kind {
                1 | 14 | 17 => 4, // int, var, decl tag
                3 => 12,          // array
                KIND_STRUCT | KIND_UNION => {
                    for m in 0..vlen {
                        let (name, ty, offset) = (word(at + m * 12)?, word(at + m * 12 + 4)?, word(at + m * 12 + 8)?);
                        members.push((name, ty, if kind_flag { offset & 0x00ff_ffff } else { offset }));
                    }
                    vlen * 12
                }
                6 | 13 => vlen * 8,        // enum, function prototype
                15 | 19 => vlen * 12,      // data section, 64-bit enum
                2 | 7..=12 | 16 | 18 => 0, // pointer, forward, typedef, qualifiers, func, float, type tag
                other => bail!("BTF kind {other} unknown to kpr"),
            };
            at += trailing;
            types.push(Type { kind, name, members });
        }
        Ok(Self { strings, types })
    }

    fn name(&self, offset: u32) -> &[u8] {
        let rest = self.strings.get(offset as usize..).unwrap_or_default();
        &rest[..rest.iter().position(|&b| b == 0).unwrap_or(rest.len())]
    }

    fn find(&self, kind: u32, name: &str) -> Option<u32> {
        let id = self.types.iter().position(|t| t.kind == kind && self.name(t.name) == name.as_bytes())?;
        Some(id as u32 + 1)
    }

    fn get(&self, id: u32) -> Option<&Type> {
        self.types.get(id.checked_sub(1)? as usize)
    }

    /// The BTF id of the kernel function `name` (a kfunc's, for a call to it).
    pub fn func_id(&self, name: &str) -> Option<u32> {
        self.find(KIND_FUNC, name)
    }

    /// The bit offset of `field` in `struct name`, looked for through anonymous members (the
    /// kernel groups fields in unnamed structs and unions).
    pub fn field_bit_offset(&self, name: &str, field: &str) -> Option<u32> {
        self.member_offset(self.find(KIND_STRUCT, name)?, field.as_bytes(), 0)
    }

    fn member_offset(&self, id: u32, field: &[u8], base: u32) -> Option<u32> {
        for &(name, ty, offset) in &self.get(id)?.members {
            if self.name(name) == field {
                return Some(base + offset);
            }
            let anonymous_group =
                name == 0 && self.get(ty).is_some_and(|t| t.kind == KIND_STRUCT || t.kind == KIND_UNION);
            if anonymous_group && let Some(found) = self.member_offset(ty, field, base + offset) {
                return Some(found);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_kfunc_and_a_bit_field_of_the_running_kernel() {
        let Ok(btf) = KernelBtf::from_sys_fs() else { return }; // no BTF: nothing to read
        // `len` is a plain member of sk_buff, in every kernel kpr supports, past its first words.
        let len = btf.field_bit_offset("sk_buff", "len").expect("sk_buff.len");
        assert!(len % 32 == 0 && len > 0, "{len}");
        // ip_summed is a 2-bit field inside an unnamed group, after len.
        let summed = btf.field_bit_offset("sk_buff", "ip_summed").expect("sk_buff.ip_summed");
        assert!(summed > len, "{summed}");
        assert!(btf.field_bit_offset("sk_buff", "no_such_field").is_none());
        assert!(btf.func_id("no_such_function").is_none());
        if crate::datapath::bpf::kernel_since(6, 2) {
            assert!(btf.func_id("bpf_cast_to_kern_ctx").is_some_and(|id| id > 0));
        }
    }

    #[test]
    fn refuses_what_is_not_btf() {
        assert!(KernelBtf::parse(b"not btf at all, not at all").is_err());
        assert!(KernelBtf::parse(&[0x9f, 0xeb, 1, 0]).is_err());
    }
}
