package clocktest_test

import (
	"fmt"
	"time"

	"github.com/kvselect/kvselect/internal/clocktest"
)

func ExampleClock() {
	c := clocktest.New(time.Unix(100, 0).UTC())
	fmt.Println(c.Now().Unix())
	fmt.Println(c.Advance(time.Minute).Unix(), c.Now().Unix())
	// Output:
	// 100
	// 160 160
}
