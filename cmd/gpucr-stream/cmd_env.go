package main

import (
	"context"
	"fmt"
	"text/tabwriter"

	"github.com/gpucr/gpucr-stream/knobs"
	"github.com/gpucr/gpucr-stream/redact"
)

var envCommand = command{"env", "print gpucr-stream's environment variables (each flag's, then the others) with their values here; secrets are not shown", "",
	func() options { return envOptions{} }}

type envOptions struct{}

func (envOptions) register(f *flags) { f.show("json") }

// envVar is one variable as env prints it.
type envVar struct {
	Name    string `json:"name"`
	Set     bool   `json:"set"`
	Value   string `json:"value,omitempty"`
	Secret  bool   `json:"secret,omitempty"`
	Flag    string `json:"flag,omitempty"`
	Meaning string `json:"meaning"`
}

func (envOptions) run(ctx context.Context, c *cli, args []string) error {
	if len(args) > 0 {
		return usagef("env takes no arguments")
	}
	vars := envVars()
	if c.json {
		return c.printJSON(vars)
	}
	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "VARIABLE\tVALUE\tMEANING")
	for _, v := range vars {
		val := v.Value
		switch {
		case !v.Set:
			val = "-"
		case v.Secret:
			val = "(set, not shown)"
		case val == "":
			val = `""`
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\n", v.Name, val, v.Meaning)
	}
	return tw.Flush()
}

// envVars are every flag's variable, then the knobs, with their values
// (secrets left out).
func envVars() []envVar {
	var vars []envVar
	for _, d := range flagTable {
		if !hasEnv(d.name) {
			continue
		}
		name := knobs.FlagVar(d.name)
		v, set := knobs.FlagValue(d.name)
		vars = append(vars, envVar{Name: name, Set: set, Value: v, Flag: "--" + d.name, Secret: redact.SecretEnv(name),
			Meaning: "the default of --" + d.name})
	}
	for _, k := range knobs.All() {
		v, set := k.Lookup()
		meaning := k.Meaning
		if k.Library {
			meaning = "libgpucr-preload: " + meaning
		}
		vars = append(vars, envVar{Name: k.Name, Set: set, Value: v, Secret: k.Secret, Meaning: meaning})
	}
	for i := range vars {
		if vars[i].Secret {
			vars[i].Value = ""
		}
	}
	return vars
}
