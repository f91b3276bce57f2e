// Command coreuser is a program outside the kvselect module that imports every
// core package, as a custom Endpoint Picker or gateway would. The root module's
// TestCoreModuleGraph lists its module graph: what `go get` of the core brings
// into an importer's build.
package main

import (
	"fmt"

	"github.com/kvselect/kvselect/catalog"
	"github.com/kvselect/kvselect/kvindex"
	"github.com/kvselect/kvselect/kvindex/kvevents"
	"github.com/kvselect/kvselect/replica"
	"github.com/kvselect/kvselect/reservation"
	"github.com/kvselect/kvselect/roles"
	"github.com/kvselect/kvselect/selection"
	"github.com/kvselect/kvselect/selection/httproute"
	"github.com/kvselect/kvselect/tokenize"
)

func main() {
	cfg := selection.DefaultConfig(16)
	fmt.Println(cfg.Validate() == nil, catalog.Schedulable, kvindex.TierDevice, kvevents.DefaultQueueLen,
		reservation.ErrUnknownReservation, roles.Prefill, tokenize.ErrBadRequest, replica.DefaultSubject,
		httproute.HeaderSessionID)
}
