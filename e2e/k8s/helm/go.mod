// Wrapper module: builds the helm CLI for the chart tests from its Go module.
module servefleet.io/e2e/helm

go 1.24.0

require helm.sh/helm/v3 v3.19.5
