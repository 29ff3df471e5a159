//! kube-proxy's iptables mode, read from `iptables-save`: its chains of the `nat` and `filter`
//! tables (named `nat/KUBE-SERVICES`, `filter/KUBE-SERVICES`, ...), and of the built-in
//! filter chains only the jumps to its own.
use std::collections::HashMap;

use anyhow::{Result, bail};

use super::{Action, Chain, Match, Rule, RuleSet, parse_net, protocol_number};

/// kube-proxy's filter chains the built-in ones jump to for a new connection (KUBE-FORWARD,
/// KUBE-NODEPORTS and KUBE-FIREWALL only concern established or health-check traffic, or
/// 127.0.0.0/8).
const FILTER_CHAINS: [&str; 3] = ["KUBE-PROXY-FIREWALL", "KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES"];

pub fn parse(text: &str) -> Result<RuleSet> {
    let mut set = RuleSet {
        nat_entry: vec!["nat/KUBE-SERVICES".into()],
        filter_input: "filter/INPUT".into(),
        filter_forward: "filter/FORWARD".into(),
        filter_output: "filter/OUTPUT".into(),
        ..RuleSet::default()
    };
    // Every rule by chain (`table/chain`), as (line number, words after the chain's name).
    let mut lines: HashMap<String, Vec<(usize, Vec<String>)>> = HashMap::new();
    let mut table = String::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.trim();
        if let Some(name) = line.strip_prefix('*') {
            table = name.to_owned();
        } else if let Some(rest) = line.strip_prefix("-A ")
            && (table == "nat" || table == "filter")
        {
            let mut words = split_words(rest);
            if words.is_empty() {
                continue;
            }
            let chain = words.remove(0);
            lines.entry(format!("{table}/{chain}")).or_default().push((number + 1, words));
        }
    }
    let services = lines.get("nat/KUBE-SERVICES").map(Vec::as_slice).unwrap_or_default();
    if services.iter().any(|(_, words)| words.iter().any(|w| w == "--match-set")) {
        bail!(
            "kube-proxy's IPVS mode (ipset matches in KUBE-SERVICES): shadow mode compares its iptables and nftables modes"
        );
    }
    // Only the chains a new connection can reach from kube-proxy's entry points are read:
    // other software's rules (kube-router's, a CNI's) never stop the comparison.
    let mut todo: Vec<String> =
        ["nat/KUBE-SERVICES", "filter/INPUT", "filter/FORWARD", "filter/OUTPUT"].map(String::from).into();
    while let Some(name) = todo.pop() {
        if set.chains.contains_key(&name) {
            continue;
        }
        let (table, chain) = name.split_once('/').unwrap_or_default();
        let builtin = !chain.starts_with("KUBE-");
        let mut rules = Vec::new();
        for (number, words) in lines.get(&name).map(Vec::as_slice).unwrap_or_default() {
            let target = words.windows(2).find(|w| w[0] == "-j" || w[0] == "-g").map(|w| w[1].as_str());
            // Of a built-in chain, only the jumps to kube-proxy's filter chains.
            if builtin && !target.is_some_and(|t| FILTER_CHAINS.contains(&t)) {
                continue;
            }
            let rule =
                parse_rule(table, words).map_err(|e| anyhow::anyhow!("line {number}: {e}: {}", words.join(" ")))?;
            if let Action::Jump(next) | Action::Goto(next) = &rule.action {
                todo.push(next.clone());
            }
            rules.push(rule);
        }
        let chain = Chain::new(rules, chain.starts_with("KUBE-FW-"), name == "nat/KUBE-NODEPORTS");
        set.chains.insert(name, chain);
    }
    Ok(set)
}

/// Words, with `"quoted text"` as one.
fn split_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut chars = line.chars().peekable();
    while let Some(&c) = chars.peek() {
        if c.is_whitespace() {
            chars.next();
            continue;
        }
        let mut word = String::new();
        if c == '"' {
            chars.next();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => word.extend(chars.next()),
                    '"' => break,
                    c => word.push(c),
                }
            }
        } else {
            while let Some(&c) = chars.peek().filter(|c| !c.is_whitespace()) {
                word.push(c);
                chars.next();
            }
        }
        words.push(word);
    }
    words
}

fn parse_rule(table: &str, args: &[String]) -> Result<Rule> {
    let mut matches = Vec::new();
    let mut action = Action::Continue;
    let mut negated = false;
    let mut recent_check = false;
    let mut seconds = 0;
    let mut words = args.iter().map(String::as_str);
    let value = |words: &mut dyn Iterator<Item = &str>, flag: &str| -> Result<String> {
        match words.next() {
            Some(v) => Ok(v.to_owned()),
            None => bail!("{flag} without a value"),
        }
    };
    while let Some(word) = words.next() {
        if word == "!" {
            negated = true;
            continue;
        }
        match word {
            "-s" | "--source" | "-d" | "--destination" => {
                let v = value(&mut words, word)?;
                let nets = v.split(',').map(|n| parse_net(n).ok_or_else(|| anyhow::anyhow!("bad address {n}")));
                let nets = nets.collect::<Result<Vec<_>>>()?;
                matches.push(if word.starts_with("-s") || word == "--source" {
                    Match::Src { nets, negated }
                } else {
                    Match::Dst { nets, negated }
                });
            }
            "-p" | "--protocol" | "--dport" | "--destination-port" if negated => {
                bail!("a negated {word} (kube-proxy writes none)")
            }
            "-p" | "--protocol" => {
                let v = value(&mut words, word)?;
                // Another protocol than a Service's: never one of their connections.
                matches.push(protocol_number(&v).map_or(Match::Never, Match::Proto));
            }
            "--dport" | "--destination-port" => {
                let v = value(&mut words, word)?;
                matches.push(Match::DPort(v.parse().map_err(|_| anyhow::anyhow!("bad port {v}"))?));
            }
            "-i" | "--in-interface" => {
                matches.push(Match::InLink { name: value(&mut words, word)?, negated });
            }
            "--src-type" | "--dst-type" => {
                let local = value(&mut words, word)? == "LOCAL";
                let want = local != negated;
                matches.push(if word == "--src-type" { Match::SrcLocal(want) } else { Match::DstLocal(want) });
            }
            "--ctstate" => {
                let states = value(&mut words, word)?;
                let new = states.split(',').any(|s| s == "NEW");
                matches.push(if new == negated { Match::Never } else { Match::Always });
            }
            "--mark" => {
                value(&mut words, word)?;
                // A new Service connection carries no mark before kube-proxy's own rules set one.
                if !negated {
                    matches.push(Match::Never);
                }
            }
            "--mode" => {
                if value(&mut words, word)? == "random" {
                    matches.push(Match::Random);
                }
            }
            "--rcheck" | "--update" => recent_check = true,
            "--seconds" => seconds = value(&mut words, word)?.parse().unwrap_or(0),
            "-j" | "-g" => {
                let target = value(&mut words, word)?;
                action = match target.as_str() {
                    "KUBE-MARK-MASQ" => Action::MarkMasquerade,
                    "KUBE-MARK-DROP" => Action::MarkDrop,
                    "DNAT" => Action::Continue, // its --to-destination follows
                    "REJECT" => Action::Reject,
                    "DROP" => Action::Drop,
                    "ACCEPT" => Action::Accept,
                    "RETURN" => Action::Return,
                    t if t.chars().all(|c| c.is_ascii_uppercase()) => Action::Continue, // MARK, MASQUERADE, ...
                    t if word == "-g" => Action::Goto(format!("{table}/{t}")),
                    t => Action::Jump(format!("{table}/{t}")),
                };
            }
            "--to-destination" => {
                let v = value(&mut words, word)?;
                action = Action::Dnat(v.parse().map_err(|_| anyhow::anyhow!("bad DNAT destination {v}"))?);
            }
            // Options with a value that do not change the verdict.
            "-m" | "--comment" | "--name" | "--mask" | "--probability" | "--nfacct-name" | "--reject-with"
            | "--set-xmark" | "-o" | "--out-interface" => {
                value(&mut words, word)?;
            }
            // Flags without one.
            "--set" | "--rsource" | "--reap" | "--random-fully" | "--random" => {}
            other => bail!("unknown option {other}"),
        }
        negated = false;
    }
    if recent_check {
        matches.push(Match::Affinity(seconds));
    }
    Ok(Rule { matches, action })
}
