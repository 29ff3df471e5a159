// CoreDNS with only the plugins a test cluster's DNS needs (the cluster.local zone from the API
// server; no upstream resolver: nothing leaves the machine). Upstream's agnhost image carries a
// CoreDNS too; the suite's kube-dns Deployment runs this one from the agnhost image built here.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

// In CoreDNS's own order (plugin.cfg): a plugin runs before the ones after it.
var directives = []string{"ready", "health", "errors", "log", "loadbalance", "cache", "kubernetes"}

func init() {
	dnsserver.Directives = directives
}

func main() {
	coremain.Run()
}
