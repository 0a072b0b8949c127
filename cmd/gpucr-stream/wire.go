package main

// Wiring shared by the commands: their locations parsed and opened.

import (
	"context"
	"fmt"
	"os"

	"github.com/gpucr/gpucr-stream/location"
	"github.com/gpucr/gpucr-stream/store"
)

// parseLoc parses a DEST or SRC; flag names the flag for the message.
func parseLoc(flag, s string) (location.Location, error) {
	loc, err := location.Parse(s)
	if err != nil {
		return loc, usagef("%s: %v", flag, err)
	}
	return loc, nil
}

// refuseTerminal refuses a binary stream to standard output when that is a
// terminal, as compressors do: it would only garble the screen, and for
// checkpoint the process would be gone with nothing kept. Shards take the
// place of standard output where given.
func refuseTerminal(c *cli, dest location.Location, shards []int) error {
	if dest.Kind != location.Stdio || len(shards) > 0 {
		return nil
	}
	if f, ok := c.stdout.(*os.File); ok && isTerminal(f) {
		return usagef("refusing to write a binary stream to a terminal: redirect standard output (> FILE, | ssh HOST ...) or give --to DIR, s3://BUCKET/PREFIX/NAME or tcp://HOST:PORT")
	}
	return nil
}

// refuseNoCopy refuses a checkpoint whose only copy would go to standard
// output when that is a character device (a terminal, /dev/null): the
// process would be gone with the checkpoint kept nowhere. A pipe or a file
// holds a copy.
func refuseNoCopy(c *cli, dest location.Location) error {
	if err := refuseTerminal(c, dest, nil); err != nil || dest.Kind != location.Stdio {
		return err
	}
	f, ok := c.stdout.(*os.File)
	if !ok {
		return nil
	}
	if st, err := f.Stat(); err != nil || st.Mode()&os.ModeCharDevice == 0 {
		return nil
	}
	name, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", f.Fd()))
	if err != nil {
		name = "a character device"
	}
	return usagef("refusing to checkpoint into %s (standard output): the checkpoint would be kept nowhere and the process would be gone; redirect standard output to a file or a pipe (> FILE, | ssh HOST ...) or give --to DIR, s3://BUCKET/PREFIX/NAME or tcp://HOST:PORT", name)
}

// fromFlag is --from of the commands that also take SRC as an argument.
type fromFlag struct {
	from  string
	given bool // on the command line
}

func (o *fromFlag) register(f *flags) {
	f.str(&o.from, "from")
	f.check(func() error { o.given = f.given["from"]; return nil })
}

// srcKinds says what SRC may be.
const srcKinds = "a checkpoint directory, s3://..., a stream file, or - with a stream on standard input"

// src is the command's SRC: its one argument, else --from (standard input
// by default, but not a terminal: nobody types a stream).
func (o *fromFlag) src(c *cli, cmd string, args []string) (string, error) {
	switch len(args) {
	case 0:
		// Nor one with nothing in it (a script's /dev/null): what is
		// missing is SRC, not a stream's bytes.
		if f, ok := c.stdin.(*os.File); ok && o.from == "-" {
			switch {
			case isTerminal(f):
				return "", usagef("%s needs SRC (%s)", cmd, srcKinds)
			case location.EmptyInput(f):
				return "", usagef("%s needs SRC: standard input is empty (%s)", cmd, srcKinds)
			}
		}
		return o.from, nil
	case 1:
		if o.given {
			return "", usagef("%s: give SRC once: --from %s or the argument %s, not both", cmd, o.from, args[0])
		}
		return args[0], nil
	}
	return "", usagef("%s takes one SRC argument, got %d", cmd, len(args))
}

// storeAt opens the store of the one LOCATION argument of ls, rm, gc and
// check.
func storeAt(ctx context.Context, c *cli, loc *locationFlags, cmd string, args []string) (store.Store, location.Location, func(), error) {
	if len(args) != 1 {
		return nil, location.Location{}, nil, usagef("%s takes one LOCATION argument, got %d", cmd, len(args))
	}
	l, err := location.Parse(args[0])
	if err != nil {
		return nil, l, nil, usagef("%s: %v", cmd, err)
	}
	st, closeStore, err := location.OpenStore(ctx, l, loc.config(c, nil))
	if err != nil {
		return nil, l, nil, fmt.Errorf("%s: %w", cmd, err)
	}
	return st, l, closeStore, nil
}
