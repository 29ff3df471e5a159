// CoreDNS with only the plugins a test cluster's DNS and the DNS specs need (the cluster.local
// zone from the API server, a hosts table, forwarding to another server of the test's). Upstream's agnhost image carries a
// CoreDNS too; the suite's kube-dns Deployment runs this one from the agnhost image built here.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/hosts"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

// In CoreDNS's own order (plugin.cfg): a plugin runs before the ones after it. `hosts` and
// `forward` serve the DNS specs' own servers (a hosts table; a stub domain).
var directives = []string{"ready", "health", "errors", "log", "loadbalance", "cache", "hosts", "kubernetes", "forward"}

func init() {
	dnsserver.Directives = directives
}

func main() {
	coremain.Run()
}
