//! kube-proxy's nftables mode, read from `nft -j list table ip|ip6 kube-proxy`: the rules of
//! its chains, with each verdict map lookup (`... vmap @service-ips`, `numgen random mod N
//! vmap { ... }`) unrolled into one rule per element, and named sets resolved.
use std::{collections::HashMap, net::SocketAddr};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use super::{Action, Chain, Match, Rule, RuleSet, parse_net, protocol_number};

/// kube-proxy's masquerade mark (`meta mark set meta mark | 0x4000`).
const MASQUERADE_MARK: u64 = 0x4000;

/// A named set or map of the table.
#[derive(Default)]
struct Named {
    /// Elements: a key (one value per component) and, for a verdict map, the verdict.
    elements: Vec<(Vec<Value>, Option<Value>)>,
    /// A set's timeout in seconds (the affinity sets).
    timeout: u32,
}

pub fn parse(json: &str) -> Result<RuleSet> {
    let doc: Value = serde_json::from_str(json).context("not JSON")?;
    let items = doc["nftables"].as_array().context("no `nftables` array")?;
    let mut named: HashMap<String, Named> = HashMap::new();
    for item in items {
        for kind in ["set", "map"] {
            if let Some(set) = item.get(kind) {
                let name = set["name"].as_str().unwrap_or_default().to_owned();
                let mut n = Named { timeout: set["timeout"].as_u64().unwrap_or(0) as u32, ..Named::default() };
                for elem in set["elem"].as_array().into_iter().flatten() {
                    let (key, verdict) = match elem {
                        Value::Array(pair) if kind == "map" && pair.len() == 2 => (&pair[0], Some(pair[1].clone())),
                        key => (key, None),
                    };
                    n.elements.push((components(key), verdict));
                }
                named.insert(name, n);
            }
        }
    }
    let mut set = RuleSet {
        nat_entry: vec!["nat-prerouting".into()],
        filter_input: "filter-input".into(),
        filter_forward: "filter-forward".into(),
        filter_output: "filter-output".into(),
        filter_pre_nat_in: "filter-prerouting-pre-dnat".into(),
        filter_pre_nat_out: "filter-output-pre-dnat".into(),
        ..RuleSet::default()
    };
    let mut rules_of: HashMap<String, Vec<Rule>> = HashMap::new();
    for item in items {
        if let Some(chain) = item.get("chain") {
            rules_of.entry(chain["name"].as_str().unwrap_or_default().to_owned()).or_default();
        }
    }
    for item in items {
        let Some(rule) = item.get("rule") else { continue };
        let chain = rule["chain"].as_str().unwrap_or_default().to_owned();
        let exprs = rule["expr"].as_array().cloned().unwrap_or_default();
        let rules = read_rule(&exprs, &named).with_context(|| format!("a rule of chain {chain}: {}", rule["expr"]))?;
        rules_of.entry(chain).or_default().extend(rules);
    }
    for (name, rules) in rules_of {
        let firewall = name.starts_with("firewall-") && name != "firewall-check";
        set.chains.insert(name, Chain::new(rules, firewall, false));
    }
    Ok(set)
}

/// The values of a key: the parts of a concatenation, or the one value (an element with a
/// comment is `{"elem": {"val": ...}}`).
fn components(key: &Value) -> Vec<Value> {
    let key = key.get("elem").map_or(key, |e| &e["val"]);
    match key.get("concat").and_then(Value::as_array) {
        Some(parts) => parts.clone(),
        None => vec![key.clone()],
    }
}

/// One rule of the table, as one or more rules (a verdict map becomes one per element).
fn read_rule(exprs: &[Value], named: &HashMap<String, Named>) -> Result<Vec<Rule>> {
    let mut matches = Vec::new();
    for (index, expr) in exprs.iter().enumerate() {
        let last = index + 1 == exprs.len();
        if let Some(m) = expr.get("match") {
            matches.push(read_match(m, named)?);
            continue;
        }
        if let Some(vmap) = expr.get("vmap") {
            return unroll(&matches, &vmap["key"], &vmap["data"], named);
        }
        if let Some(dnat) = expr.get("dnat") {
            return dnat_rules(&matches, dnat);
        }
        let action = match expr {
            Value::Object(o) if o.contains_key("mangle") => {
                let value = &o["mangle"]["value"];
                let sets_mark = value.get("|").and_then(|v| v[1].as_u64()) == Some(MASQUERADE_MARK);
                if sets_mark { Action::MarkMasquerade } else { Action::Continue }
            }
            Value::Object(o) if o.contains_key("reject") => Action::Reject,
            Value::Object(o) if o.contains_key("masquerade") => Action::Continue,
            other => match verdict(other) {
                Some(action) => action,
                // counter, update @affinity-..., log, ...: no verdict.
                None if !last => continue,
                None => Action::Continue,
            },
        };
        return Ok(vec![Rule { matches, action }]);
    }
    Ok(vec![Rule { matches, action: Action::Continue }])
}

fn verdict(v: &Value) -> Option<Action> {
    let target = |k: &str| v.get(k).and_then(|t| t["target"].as_str()).map(str::to_owned);
    if let Some(t) = target("jump") {
        Some(if t == "mark-for-masquerade" { Action::MarkMasquerade } else { Action::Jump(t) })
    } else if let Some(t) = target("goto") {
        Some(Action::Goto(t))
    } else if v.get("drop").is_some() {
        Some(Action::Drop)
    } else if v.get("accept").is_some() {
        Some(Action::Accept)
    } else if v.get("return").is_some() {
        Some(Action::Return)
    } else {
        None
    }
}

/// `key vmap data`: one rule per element, matching the element's key. A random pick
/// (`numgen`) makes every element but the last a random branch (the last is taken when the
/// others are not).
fn unroll(before: &[Match], key: &Value, data: &Value, named: &HashMap<String, Named>) -> Result<Vec<Rule>> {
    let fields = components(key);
    let elements: Vec<(Vec<Value>, Option<Value>)> = match data {
        Value::String(name) => {
            let name = name.trim_start_matches('@');
            named.get(name).map(|n| n.elements.clone()).unwrap_or_default()
        }
        other => other["set"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|pair| Some((components(pair.get(0)?), Some(pair.get(1)?.clone()))))
            .collect(),
    };
    let count = elements.len();
    let mut rules = Vec::new();
    for (index, (values, verdict_value)) in elements.into_iter().enumerate() {
        let mut matches = before.to_vec();
        for (field, value) in fields.iter().zip(&values) {
            if field.get("numgen").is_some() {
                if index + 1 < count {
                    matches.push(Match::Random);
                }
                continue;
            }
            matches.push(field_match(field, value, false, named)?);
        }
        let action = verdict_value.as_ref().and_then(verdict).context("a verdict map element without a verdict")?;
        rules.push(Rule { matches, action });
    }
    Ok(rules)
}

/// `dnat to ADDR:PORT`, or `dnat to numgen random mod N map { 0 : ADDR . PORT, ... }`.
fn dnat_rules(before: &[Match], dnat: &Value) -> Result<Vec<Rule>> {
    let to = |addr: &Value, port: &Value| -> Result<SocketAddr> {
        let ip: std::net::IpAddr = addr.as_str().context("a DNAT address")?.parse()?;
        Ok(SocketAddr::new(ip, port.as_u64().context("a DNAT port")? as u16))
    };
    let addr = &dnat["addr"];
    if let Some(map) = addr.get("map") {
        let pairs = map["data"]["set"].as_array().context("a DNAT map")?;
        let count = pairs.len();
        let mut rules = Vec::new();
        for (index, pair) in pairs.iter().enumerate() {
            let parts = components(&pair[1]);
            let mut matches = before.to_vec();
            if index + 1 < count {
                matches.push(Match::Random);
            }
            let target = to(parts.first().context("a DNAT map element")?, parts.get(1).unwrap_or(&Value::Null))?;
            rules.push(Rule { matches, action: Action::Dnat(target) });
        }
        return Ok(rules);
    }
    Ok(vec![Rule { matches: before.to_vec(), action: Action::Dnat(to(addr, &dnat["port"])?) }])
}

fn read_match(m: &Value, named: &HashMap<String, Named>) -> Result<Match> {
    let negated = m["op"].as_str() == Some("!=");
    field_match(&m["left"], &m["right"], negated, named)
}

/// `left op right` for one field of a packet.
fn field_match(left: &Value, right: &Value, negated: bool, named: &HashMap<String, Named>) -> Result<Match> {
    if let Some(payload) = left.get("payload") {
        let field = payload["field"].as_str().unwrap_or_default();
        return match field {
            "saddr" | "daddr" => {
                let (nets, from_set) = addresses(right, named)?;
                Ok(match (field, from_set.as_deref()) {
                    (_, Some(name)) if name.starts_with("affinity-") && !negated => {
                        Match::Affinity(named.get(name).map_or(0, |n| n.timeout))
                    }
                    ("daddr", Some("nodeport-ips")) => Match::NodePortDst(nets),
                    ("saddr", _) => Match::Src { nets, negated },
                    _ => Match::Dst { nets, negated },
                })
            }
            "dport" if !negated => Ok(Match::DPort(right.as_u64().context("a port")? as u16)),
            "dport" => bail!("a negated port match (kube-proxy writes none)"),
            other => bail!("unknown payload field {other}"),
        };
    }
    if let Some(meta) = left.get("meta") {
        return match meta["key"].as_str().unwrap_or_default() {
            "l4proto" if negated => bail!("a negated protocol match (kube-proxy writes none)"),
            "l4proto" => {
                let proto = right.as_str().and_then(protocol_number).or_else(|| u8::try_from(right.as_u64()?).ok());
                Ok(proto.map_or(Match::Never, Match::Proto))
            }
            "iifname" => {
                let name = right.as_str().unwrap_or_default().replace('*', "+");
                Ok(Match::InLink { name, negated })
            }
            // A mark: none on a new Service connection.
            _ => Ok(if negated { Match::Always } else { Match::Never }),
        };
    }
    if let Some(fib) = left.get("fib") {
        let flags = fib["flags"].to_string();
        let local = (right.as_str() == Some("local")) != negated;
        return Ok(if flags.contains("saddr") { Match::SrcLocal(local) } else { Match::DstLocal(local) });
    }
    if let Some(ct) = left.get("ct") {
        let new = ct["key"].as_str() == Some("state") && right.to_string().contains("new");
        return Ok(if new != negated { Match::Always } else { Match::Never });
    }
    // `ct status dnat ... @hairpin-connections`, `meta mark & 0x4000`: not a new connection's.
    Ok(Match::Never)
}

/// The nets an address match names, and the named set it took them from.
fn addresses(right: &Value, named: &HashMap<String, Named>) -> Result<(Vec<super::Cidr>, Option<String>)> {
    let one = |v: &Value| -> Result<super::Cidr> {
        if let Some(p) = v.get("prefix") {
            let text = format!("{}/{}", p["addr"].as_str().unwrap_or_default(), p["len"]);
            return parse_net(&text).with_context(|| format!("a prefix {text}"));
        }
        let text = v.as_str().context("an address")?;
        parse_net(text).with_context(|| format!("an address {text}"))
    };
    match right {
        Value::String(s) if s.starts_with('@') => {
            let name = &s[1..];
            let elements = named.get(name).map(|n| n.elements.as_slice()).unwrap_or_default();
            let nets = elements.iter().filter_map(|(key, _)| key.first().and_then(|v| one(v).ok())).collect();
            Ok((nets, Some(name.to_owned())))
        }
        Value::Object(o) if o.contains_key("set") => {
            let nets = o["set"].as_array().into_iter().flatten().map(one).collect::<Result<_>>()?;
            Ok((nets, None))
        }
        other => Ok((vec![one(other)?], None)),
    }
}
