//go:build tools

// The programs built beside the suite: its runner and the images' binaries.
package e2e

import (
	_ "github.com/onsi/ginkgo/v2/ginkgo"
	_ "k8s.io/kubernetes/test/images/agnhost"
	_ "k8s.io/kubernetes/test/images/regression-issue-74839"
	_ "kpr.local/tools/e2e/coredns"
)
