package analyzer

import (
	"fmt"
	"go/ast"
	"go/types"
)

// checkHandlers finds the handlers and checks rules pool-write and
// http-outside-op in them. A handler is a function attached behind the
// consumer's middleware (the handler argument of a consumer door), or a
// function of handler type that reads the attempt's transaction (it
// expects to run behind the middleware wherever it is attached, another
// package included).
func (c *checker) checkHandlers() {
	check := func(h ast.Node) {
		if d, ok := h.(*ast.FuncDecl); ok {
			c.handled[d] = true
		}
		c.walkHandler(h)
	}
	for _, f := range c.pass.Files {
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.CallExpr:
				if !isMethod(c.callee(n), middlewarePath, consumerType, consumerDoors) {
					return true
				}
				for _, a := range n.Args {
					if isHandlerType(c.typeOf(a)) {
						for _, h := range c.handlerFuncs(a, true) {
							check(h)
						}
						c.reportImported(a)
					}
				}
			case *ast.FuncDecl:
				if fn, ok := c.pass.TypesInfo.Defs[n.Name].(*types.Func); ok && n.Body != nil &&
					isHandlerType(fn.Type()) && c.readsAttemptTx(n.Body) {
					check(n)
				}
			case *ast.FuncLit:
				if isHandlerType(c.typeOf(n)) && c.readsAttemptTx(n.Body) {
					check(n)
				}
			}
			return true
		})
	}
}

// walkHandler checks one handler: a *ast.FuncDecl or *ast.FuncLit.
func (c *checker) walkHandler(h ast.Node) {
	w := &handlerWalk{c: c, visited: make(map[walkKey]bool)}
	lit, _ := h.(*ast.FuncLit)
	w.walk(funcBody(h), c.inOp[lit], 0, nil, false)
}

// readsAttemptTx reports whether body calls an attempt accessor.
func (c *checker) readsAttemptTx(body *ast.BlockStmt) bool {
	found := false
	ast.Inspect(body, func(n ast.Node) bool {
		if call, ok := n.(*ast.CallExpr); ok && isFuncRef(c.callee(call), attemptTxAccessors) {
			found = true
		}
		return !found
	})
	return found
}

// isHandlerType reports whether t is a function type whose first parameter
// is a *message.Message (message.HandlerFunc, NoPublishHandlerFunc, …).
func isHandlerType(t types.Type) bool {
	if t == nil {
		return false
	}
	sig, ok := t.Underlying().(*types.Signature)
	return ok && sig.Params().Len() > 0 && isMessagePtr(sig.Params().At(0).Type())
}

// handlerFuncs resolves a handler argument to the functions of this package
// that it runs: a function literal; a function or method (value) declared
// in the package; a variable bound to a function literal; a conversion of
// one of those; and, when factory is true, the functions returned by a call
// of a function declared in the package (a handler factory).
func (c *checker) handlerFuncs(e ast.Expr, factory bool) []ast.Node {
	info := c.pass.TypesInfo
	switch e := ast.Unparen(e).(type) {
	case *ast.FuncLit:
		return []ast.Node{e}
	case *ast.Ident:
		switch obj := info.Uses[e].(type) {
		case *types.Func:
			if d := c.decls[obj.Origin()]; d != nil {
				return []ast.Node{d}
			}
		case *types.Var:
			var out []ast.Node
			for _, lit := range c.funcLits[obj] {
				out = append(out, lit)
			}
			return out
		}
	case *ast.SelectorExpr:
		var fn *types.Func
		if sel, ok := info.Selections[e]; ok {
			fn, _ = sel.Obj().(*types.Func) // method value h.Handle
		} else {
			fn, _ = info.Uses[e.Sel].(*types.Func) // pkg.F: declared elsewhere
		}
		if fn != nil {
			if d := c.decls[fn.Origin()]; d != nil {
				return []ast.Node{d}
			}
		}
	case *ast.CallExpr:
		if tv, ok := info.Types[e.Fun]; ok && tv.IsType() && len(e.Args) == 1 {
			return c.handlerFuncs(e.Args[0], factory) // message.HandlerFunc(f)
		}
		if !factory {
			return nil
		}
		fn := c.callee(e)
		if fn == nil {
			return nil
		}
		d := c.decls[fn]
		if d == nil {
			return nil
		}
		var out []ast.Node
		ast.Inspect(d.Body, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.FuncLit:
				return false // its returns are its own
			case *ast.ReturnStmt:
				for _, r := range n.Results {
					if isHandlerType(c.typeOf(r)) {
						out = append(out, c.handlerFuncs(r, false)...)
					}
				}
			}
			return true
		})
		return out
	}
	return nil
}

// handlerWalk checks one handler and the functions it calls, one level
// deep.
type handlerWalk struct {
	c       *checker
	visited map[walkKey]bool
}

type walkKey struct {
	body      *ast.BlockStmt
	inOp, all bool
}

// walk checks body; inOp is true inside a function passed to an operation
// scope, depth is 0 in the handler and 1 in a function it calls. outer
// holds the ranges of the enclosing function that run with no attempt
// (see noAttempt); all is true when the whole body does.
func (w *handlerWalk) walk(body *ast.BlockStmt, inOp bool, depth int, outer []posRange, all bool) {
	if body == nil || w.visited[walkKey{body, inOp, all}] {
		return
	}
	w.visited[walkKey{body, inOp, all}] = true
	c := w.c
	none := append(c.noAttempt(body), outer...)
	ast.Inspect(body, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.FuncLit:
			if c.inOp[n] && !inOp {
				w.walk(n.Body, true, depth, none, all)
				return false
			}
		case *ast.CallExpr:
			fn := c.callee(n)
			noAttempt := all || within(none, n.Pos())
			if !noAttempt {
				c.checkOutsideHandle(n, fn)
			}
			if !inOp {
				c.checkHTTP(n, fn)
			}
			if depth == 0 {
				if d := c.followable(n, fn); d != nil {
					w.walk(d.Body, inOp, depth+1, nil, noAttempt)
				}
			}
		}
		return true
	})
}

// followable returns the declaration of fn when the handler's call of it
// is followed: fn is declared in this package and the call passes it a
// *message.Message or a context.Context.
func (c *checker) followable(call *ast.CallExpr, fn *types.Func) *ast.FuncDecl {
	if fn == nil {
		return nil
	}
	d := c.decls[fn]
	if d == nil {
		return nil
	}
	for _, a := range call.Args {
		if t := c.typeOf(a); isMessagePtr(t) || isContext(t) {
			return d
		}
	}
	return nil
}

// checkOutsideHandle: rule pool-write.
func (c *checker) checkOutsideHandle(call *ast.CallExpr, fn *types.Func) {
	if fn == nil {
		return
	}
	if isFuncRef(fn, beginFuncs) && len(call.Args) > 1 {
		if h := handleOf(c.typeOf(call.Args[1])); h != nil {
			c.report(call, rulePoolWrite, fmt.Sprintf(
				"idemvet: transaction of its own on %s in a handler (%s): use the attempt's transaction (%s) so the effect commits with the claim",
				h.display, shortName(fn), h.accessor))
		}
		return
	}
	recv := fn.Type().(*types.Signature).Recv()
	if recv == nil {
		return
	}
	h := handleOf(recv.Type())
	if h == nil {
		return
	}
	name := fn.Name()
	switch {
	case handleWrites[name]:
		c.report(call, rulePoolWrite, fmt.Sprintf(
			"idemvet: write through %s in a handler (%s): use the attempt's transaction (%s) so the effect commits with the claim",
			h.display, name, h.accessor))
	case handleBegins[name]:
		c.report(call, rulePoolWrite, fmt.Sprintf(
			"idemvet: transaction of its own on %s in a handler (%s): use the attempt's transaction (%s) so the effect commits with the claim",
			h.display, name, h.accessor))
	case handleQueries[name]:
		if q, ok := c.sqlArg(call); ok && isWriteSQL(q) {
			c.report(call, rulePoolWrite, fmt.Sprintf(
				"idemvet: write through %s in a handler (%s of a writing statement): use the attempt's transaction (%s) so the effect commits with the claim",
				h.display, name, h.accessor))
		}
	}
}

// handleOf returns the outside handle t is (through one pointer), or nil.
func handleOf(t types.Type) *outsideHandle {
	p, n := named(t)
	for i := range outsideHandles {
		if h := &outsideHandles[i]; h.pkg == p && h.name == n {
			return h
		}
	}
	return nil
}

// checkHTTP: rule http-outside-op (the caller knows the call is outside an
// operation scope).
func (c *checker) checkHTTP(call *ast.CallExpr, fn *types.Func) {
	if fn == nil {
		return
	}
	var what string
	switch {
	case isMethod(fn, httpPath, "Client", httpClientMethods):
		what = "http.Client." + fn.Name()
	case isFunc(fn, httpPath, httpFuncs):
		what = "http." + fn.Name()
	default:
		return
	}
	c.report(call, ruleHTTP, fmt.Sprintf(
		"idemvet: HTTP call (%s) in a handler outside an operation key: make the call inside (*operation.Runner).%s so that a redelivery does not repeat it",
		what, operationScopes[0]))
}
