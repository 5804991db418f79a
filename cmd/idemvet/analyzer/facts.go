package analyzer

import (
	"fmt"
	"go/ast"
	"go/types"
	"path/filepath"
	"strings"
)

// A handler is often declared in one package and attached in another (the
// service's main wires the handlers of its packages). Each package records,
// for the functions of handler type it declares and has not checked as
// handlers itself, what rules pool-write and http-outside-op would report
// in them (ignore directives applied); the package that attaches one with
// a consumer door reports those findings at the handler argument.

// handlerFindings is the fact recorded on such a function.
type handlerFindings struct {
	Findings []finding
}

type finding struct {
	Rule, Message, Position string
}

func (*handlerFindings) AFact() {}

func (f *handlerFindings) String() string {
	var b strings.Builder
	for i, x := range f.Findings {
		if i > 0 {
			b.WriteString("; ")
		}
		fmt.Fprintf(&b, "%s at %s", x.Rule, x.Position)
	}
	return "handlerFindings(" + b.String() + ")"
}

// exportHandlerFacts records the findings of the exported functions and
// methods of handler type that were not checked as handlers here (another
// package can attach only those).
func (c *checker) exportHandlerFacts() {
	for fn, d := range c.decls {
		if c.handled[d] || !fn.Exported() || !isHandlerType(fn.Type()) {
			continue
		}
		var fs []finding
		c.sink = func(n ast.Node, rule, msg string) {
			p := c.pass.Fset.Position(n.Pos())
			fs = append(fs, finding{
				Rule:     rule,
				Message:  msg,
				Position: fmt.Sprintf("%s:%d:%d", filepath.Base(p.Filename), p.Line, p.Column),
			})
		}
		c.walkHandler(d)
		c.sink = nil
		if len(fs) > 0 {
			c.pass.ExportObjectFact(fn, &handlerFindings{Findings: fs})
		}
	}
}

// reportImported reports, at a consumer door's handler argument, the
// findings recorded on a handler declared in another package.
func (c *checker) reportImported(arg ast.Expr) {
	var fn *types.Func
	switch e := ast.Unparen(arg).(type) {
	case *ast.CallExpr:
		if tv, ok := c.pass.TypesInfo.Types[e.Fun]; ok && tv.IsType() && len(e.Args) == 1 {
			c.reportImported(e.Args[0]) // message.HandlerFunc(pkg.F)
		}
		return
	case *ast.SelectorExpr:
		if sel, ok := c.pass.TypesInfo.Selections[e]; ok {
			fn, _ = sel.Obj().(*types.Func)
		} else {
			fn, _ = c.pass.TypesInfo.Uses[e.Sel].(*types.Func)
		}
	case *ast.Ident:
		fn, _ = c.pass.TypesInfo.Uses[e].(*types.Func)
	}
	if fn == nil || fn.Pkg() == nil || fn.Pkg() == c.pass.Pkg {
		return
	}
	var f handlerFindings
	if !c.pass.ImportObjectFact(fn.Origin(), &f) {
		return
	}
	for _, x := range f.Findings {
		c.report(arg, x.Rule, fmt.Sprintf("%s [in handler %s, %s]", x.Message, shortName(fn), x.Position))
	}
}
