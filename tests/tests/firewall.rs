//! What kpr reads of a node's forward hook (`kpr::source::firewall`): whatever filters forwarded
//! packets there, written as the tools NetworkPolicy engines use write it (iptables-nft,
//! iptables-legacy, ip6tables-legacy, nftables), is found; an empty, accepting chain is not.
//! In a network namespace of the test's own. Needs root.
use kpr::{source::firewall::forward_filters, testbed};

#[test]
fn every_filter_on_the_forward_hook_is_found_and_nothing_else() {
    let ns = testbed::Netns::new(&testbed::unique_name("kfw")).unwrap();
    let filters = || ns.run(forward_filters).unwrap();
    let step = |script: &str, want: &[&str]| {
        ns.sh(script).unwrap();
        let found = filters();
        assert_eq!(found.len(), want.len(), "after `{script}`: {found:?}");
        for (line, want) in found.iter().zip(want) {
            assert!(line.contains(want), "after `{script}`: {line:?} does not say {want:?}");
        }
    };
    assert_eq!(filters(), Vec::<String>::new(), "a new namespace filters nothing");
    // iptables-nft's FORWARD chain, accepting with no rules (any iptables command makes it).
    step("iptables-nft -P FORWARD ACCEPT", &[]);
    // A NetworkPolicy engine's rule (Calico, kube-router): pod-b's port denied.
    step(
        "iptables-nft -A FORWARD -d 10.244.2.2 -p tcp --dport 8080 -j DROP",
        &["nftables ip filter/FORWARD: 1 rules, policy accept"],
    );
    step(
        "iptables-nft -F FORWARD && iptables-nft -P FORWARD DROP",
        &["nftables ip filter/FORWARD: 0 rules, policy drop"],
    );
    step("iptables-nft -P FORWARD ACCEPT", &[]);
    // nftables of its own (kube-network-policies' inet table).
    step(
        "nft add table inet np && nft add chain inet np policies '{ type filter hook forward priority 0; policy accept; }' && \
         nft add rule inet np policies ip6 daddr fd00::2 drop && nft add rule inet np policies ct state established accept",
        &["nftables inet np/policies: 2 rules, policy accept"],
    );
    // A chain on another hook filters nothing forwarded.
    step(
        "nft delete table inet np && nft add table ip other && \
         nft add chain ip other in '{ type filter hook input priority 0; policy drop; }'",
        &[],
    );
    // The legacy tables: a policy, a rule, and IPv6's table.
    step("iptables-legacy -P FORWARD DROP", &["iptables-legacy filter FORWARD: no rules, policy DROP"]);
    step("iptables-legacy -P FORWARD ACCEPT", &[]);
    step(
        "iptables-legacy -A FORWARD -s 10.244.1.2 -j REJECT",
        &["iptables-legacy filter FORWARD: rules, policy ACCEPT"],
    );
    step(
        "iptables-legacy -F FORWARD && ip6tables-legacy -P FORWARD DROP",
        &["ip6tables-legacy filter FORWARD: no rules, policy DROP"],
    );
    step(
        "ip6tables-legacy -P FORWARD ACCEPT && ip6tables-legacy -A FORWARD -j ACCEPT",
        &["ip6tables-legacy filter FORWARD: rules, policy ACCEPT"],
    );
    step("ip6tables-legacy -F FORWARD", &[]);
}
