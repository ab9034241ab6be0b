// Wrapper module: builds kube-router (its NetworkPolicy firewall is what the e2e node
// enforces policies with) from its Go module.
module servefleet.io/e2e/kuberouter

go 1.24.0

require github.com/cloudnativelabs/kube-router/v2 v2.1.0
