package source

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strings"
	"testing"
)

// TestDecoratorsForwardManifest: every type in the module that embeds a
// Source (a decorator) declares Manifest, so that ManifestOf finds an
// archive's manifest behind it (Manifester). One that did not would hide
// the manifest from every caller, a restore's carried files and GPU
// records among them, without an error.
func TestDecoratorsForwardManifest(t *testing.T) {
	fset := token.NewFileSet()
	decorators := map[string]token.Position{} // "dir.Type" -> where declared
	forwarded := map[string]bool{}
	err := filepath.WalkDir("..", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata") && path != ".." {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		dir := filepath.Dir(path)
		for _, decl := range f.Decls {
			switch decl := decl.(type) {
			case *ast.GenDecl:
				for _, spec := range decl.Specs {
					ts, ok := spec.(*ast.TypeSpec)
					if !ok {
						continue
					}
					if st, ok := ts.Type.(*ast.StructType); ok && embedsSource(st, f.Name.Name) {
						decorators[dir+"."+ts.Name.Name] = fset.Position(ts.Pos())
					}
				}
			case *ast.FuncDecl:
				if decl.Recv != nil && decl.Name.Name == "Manifest" {
					forwarded[dir+"."+receiverType(decl.Recv.List[0].Type)] = true
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(decorators) < 5 {
		t.Fatalf("found %d decorators of Source, fewer than the module has: the walk is broken", len(decorators))
	}
	for name, at := range decorators {
		if !forwarded[name] {
			t.Errorf("%s (%s) embeds a Source but does not forward Manifest (source.Manifester)", name, at)
		}
	}
}

// embedsSource says whether st embeds Source (in package source) or
// source.Source (elsewhere).
func embedsSource(st *ast.StructType, pkg string) bool {
	for _, field := range st.Fields.List {
		if len(field.Names) != 0 {
			continue
		}
		switch typ := field.Type.(type) {
		case *ast.Ident:
			if pkg == "source" && typ.Name == "Source" {
				return true
			}
		case *ast.SelectorExpr:
			if x, ok := typ.X.(*ast.Ident); ok && x.Name == "source" && typ.Sel.Name == "Source" {
				return true
			}
		}
	}
	return false
}

// receiverType is the name of a method's receiver type.
func receiverType(e ast.Expr) string {
	if star, ok := e.(*ast.StarExpr); ok {
		e = star.X
	}
	if id, ok := e.(*ast.Ident); ok {
		return id.Name
	}
	return ""
}
