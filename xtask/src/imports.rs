//! Import circles among the modules of one crate (issue 44: "no module imports, directly or
//! through others, one that imports it"). A module's imports are the paths of its `use`
//! statements and the `crate::`/`super::`/`self::` paths written inline, each resolved to the
//! longest module it names; `mod x;` is a declaration, not a use, and `#[cfg(test)] mod x { .. }`
//! blocks are left out. Checked by a unit test for proxy-user and proxy-ebpf.
use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

use anyhow::{Context as _, Result};
use regex::Regex;

type Module = Vec<String>;

/// Every strongly connected set of more than one module, each as its sorted `a::b` names.
pub fn circles(src: &Path, crate_name: &str) -> Result<Vec<Vec<String>>> {
    let mut files = Vec::new();
    collect(src, &mut files)?;
    // A binary's main.rs beside lib.rs is another crate: nothing in the library can import it.
    if src.join("lib.rs").exists() {
        files.retain(|f| f != &src.join("main.rs"));
    }
    let modules: BTreeMap<Module, String> = files
        .iter()
        .map(|f| Ok((module_of(src, f), std::fs::read_to_string(f).with_context(|| format!("{}", f.display()))?)))
        .collect::<Result<_>>()?;
    let known: BTreeSet<&Module> = modules.keys().collect();
    let use_stmt = Regex::new(r"(?m)^\s*(?:pub(?:\([a-z]+\))? )?use\s+([^;]+);")?;
    let inline = Regex::new(r"(?:^|[^\w:])((?:crate|super|self)(?:::\w+)+)")?;
    let comment = Regex::new(r"//[^\n]*")?;
    let test_block = Regex::new(r"(?m)^#\[cfg\(test\)\]\nmod \w+ \{")?;
    let mut edges: BTreeMap<&Module, BTreeSet<Module>> = BTreeMap::new();
    for (module, text) in &modules {
        let text = match test_block.find(text) {
            Some(m) => &text[..m.start()],
            None => text,
        };
        let text = comment.replace_all(text, "");
        let mut deps = BTreeSet::new();
        for cap in use_stmt.captures_iter(&text) {
            for path in use_paths(&cap[1].replace('\n', " ")) {
                deps.extend(resolve(module, &path, crate_name, &known));
            }
        }
        // Paths written inline: a `use a::{b, c}` was read whole above, and is no use of `a`.
        let body = use_stmt.replace_all(&text, "");
        for cap in inline.captures_iter(&body) {
            let path: Vec<String> = cap[1].split("::").map(str::to_owned).collect();
            deps.extend(resolve(module, &path, crate_name, &known));
        }
        deps.remove(module);
        edges.insert(module, deps);
    }
    Ok(strongly_connected(&edges)
        .into_iter()
        .filter(|set| set.len() > 1)
        .map(|set| {
            let mut names: Vec<String> =
                set.iter().map(|m| if m.is_empty() { "crate".to_owned() } else { m.join("::") }).collect();
            names.sort();
            names
        })
        .collect())
}

fn collect(dir: &Path, out: &mut Vec<std::path::PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("{}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            collect(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// `datapath/bpf/mod.rs` → `datapath::bpf`; `lib.rs` → the crate root (empty).
fn module_of(src: &Path, file: &Path) -> Module {
    let rel = file.strip_prefix(src).unwrap_or(file).with_extension("");
    let mut parts: Module = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    if parts.last().is_some_and(|l| ["mod", "lib", "main"].contains(&l.as_str())) {
        parts.pop();
    }
    parts
}

/// The paths of a use tree: `a::{b, c::{d, e as f}}` → `a::b`, `a::c::d`, `a::c::e`.
fn use_paths(tree: &str) -> Vec<Vec<String>> {
    fn walk(prefix: &[String], tree: &str, out: &mut Vec<Vec<String>>) {
        let (mut depth, mut start) = (0, 0);
        let mut parts = Vec::new();
        for (i, ch) in tree.char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(&tree[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        parts.push(&tree[start..]);
        for part in parts.into_iter().map(str::trim).filter(|p| !p.is_empty()) {
            match part.split_once('{') {
                Some((head, rest)) => {
                    let mut prefix = prefix.to_vec();
                    prefix.extend(head.trim_end_matches(':').split("::").filter(|s| !s.is_empty()).map(str::to_owned));
                    walk(&prefix, rest.rsplit_once('}').map_or(rest, |(inner, _)| inner), out);
                }
                None => {
                    let mut path = prefix.to_vec();
                    path.extend(part.split("::").map(|s| s.split(" as ").next().unwrap_or(s).trim().to_owned()));
                    out.push(path);
                }
            }
        }
    }
    let mut out = Vec::new();
    walk(&[], tree, &mut out);
    out
}

/// The longest module `path` names, seen from `from`; `None` for another crate's path.
fn resolve(from: &Module, path: &[String], crate_name: &str, known: &BTreeSet<&Module>) -> Option<Module> {
    let (mut base, rest): (Module, &[String]) = match path.first().map(String::as_str) {
        Some("crate") => (Vec::new(), &path[1..]),
        Some(name) if name == crate_name => (Vec::new(), &path[1..]),
        Some("self") => (from.clone(), &path[1..]),
        Some("super") => {
            let mut base = from.clone();
            let supers = path.iter().take_while(|s| *s == "super").count();
            base.truncate(base.len().saturating_sub(supers));
            (base, &path[supers..])
        }
        // A child module of `from`, or another crate.
        Some(first) => {
            let mut child = from.clone();
            child.push(first.to_owned());
            if !known.contains(&child) {
                return None;
            }
            (from.clone(), path)
        }
        None => return None,
    };
    let mut best = known.contains(&base).then(|| base.clone());
    for segment in rest {
        base.push(segment.clone());
        if !known.contains(&base) {
            break;
        }
        best = Some(base.clone());
    }
    best
}

/// Tarjan's strongly connected components.
fn strongly_connected<'a>(edges: &BTreeMap<&'a Module, BTreeSet<Module>>) -> Vec<Vec<&'a Module>> {
    struct State<'a, 'e> {
        edges: &'e BTreeMap<&'a Module, BTreeSet<Module>>,
        index: BTreeMap<&'a Module, usize>,
        low: BTreeMap<&'a Module, usize>,
        stack: Vec<&'a Module>,
        on_stack: BTreeSet<&'a Module>,
        out: Vec<Vec<&'a Module>>,
    }
    fn visit<'a>(s: &mut State<'a, '_>, v: &'a Module) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.edges.get(v).into_iter().flatten() {
            let Some((&w, _)) = s.edges.get_key_value(w) else { continue };
            if !s.index.contains_key(w) {
                visit(s, w);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.on_stack.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut set = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                set.push(w);
                if w == v {
                    break;
                }
            }
            s.out.push(set);
        }
    }
    let mut state = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for &v in edges.keys() {
        if !state.index.contains_key(v) {
            visit(&mut state, v);
        }
    }
    state.out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
    }

    #[test]
    fn the_agent_and_the_programs_have_no_import_circles() {
        for (src, name) in [("proxy-user/src", "kpr"), ("proxy-ebpf/src", "proxy_ebpf")] {
            let found = circles(&root().join(src), name).unwrap();
            assert!(found.is_empty(), "{src}: modules that import each other: {found:?}");
        }
    }

    #[test]
    fn a_circle_through_a_use_tree_or_an_inline_path_is_found() {
        let dir = std::env::temp_dir().join(format!("kpr-imports-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("a")).unwrap();
        std::fs::write(dir.join("lib.rs"), "mod a;\nmod b;\n").unwrap();
        std::fs::write(dir.join("a/mod.rs"), "mod c;\nuse crate::{b::X, a::c::Y};\n").unwrap();
        std::fs::write(dir.join("a/c.rs"), "pub struct Y;\n// crate::b::Z in a comment is no use\n").unwrap();
        std::fs::write(dir.join("b.rs"), "pub struct X;\nfn f() { super::a::g() }\n").unwrap();
        let found = circles(&dir, "k").unwrap();
        std::fs::write(dir.join("b.rs"), "pub struct X;\n").unwrap();
        let none = circles(&dir, "k").unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(found, vec![vec!["a".to_owned(), "b".to_owned()]]);
        assert!(none.is_empty(), "{none:?}");
    }
}
