// Wrapper module: builds the LeaderWorkerSet controller (sigs.k8s.io/lws) for the e2e tests
// from its Go module; its CRD is read from the same module (config/crd/bases).
module servefleet.io/e2e/lws

go 1.26.0

require sigs.k8s.io/lws v0.9.0
