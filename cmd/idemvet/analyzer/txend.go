package analyzer

import (
	"fmt"
	"go/ast"
	"go/types"
)

// checkAttemptTx: rule tx-end, in every function of the package (the
// accessors return a transaction only to a handler, so any value they
// return is the attempt's).
func (c *checker) checkAttemptTx() {
	info := c.pass.TypesInfo
	tracked := make(map[types.Object]bool)
	track := func(lhs []ast.Expr, rhs []ast.Expr) {
		if len(rhs) != 1 || len(lhs) == 0 {
			return
		}
		call, ok := ast.Unparen(rhs[0]).(*ast.CallExpr)
		if !ok || !isFuncRef(c.callee(call), attemptTxAccessors) {
			return
		}
		if v := c.varOf(lhs[0]); v != nil {
			tracked[v] = true
		}
	}
	for _, f := range c.pass.Files {
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.AssignStmt:
				track(n.Lhs, n.Rhs)
			case *ast.ValueSpec:
				lhs := make([]ast.Expr, len(n.Names))
				for i, id := range n.Names {
					lhs[i] = id
				}
				track(lhs, n.Values)
			}
			return true
		})
	}
	// One level: a parameter of a function of this package that receives
	// a tracked transaction.
	params := make(map[types.Object]bool)
	for _, f := range c.pass.Files {
		ast.Inspect(f, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok {
				return true
			}
			fn := c.callee(call)
			if fn == nil || c.decls[fn] == nil {
				return true
			}
			sig := fn.Type().(*types.Signature)
			for i, a := range call.Args {
				if v := c.varOf(a); v != nil && tracked[v] && i < sig.Params().Len() &&
					!(sig.Variadic() && i >= sig.Params().Len()-1) {
					params[sig.Params().At(i)] = true
				}
			}
			return true
		})
	}
	for p := range params {
		tracked[p] = true
	}
	if len(tracked) == 0 {
		return
	}
	for _, f := range c.pass.Files {
		for _, d := range f.Decls {
			own := c.savepoints(d)
			ast.Inspect(d, func(n ast.Node) bool {
				call, ok := n.(*ast.CallExpr)
				if !ok {
					return true
				}
				sel, ok := ast.Unparen(call.Fun).(*ast.SelectorExpr)
				if !ok {
					return true
				}
				id, ok := ast.Unparen(sel.X).(*ast.Ident)
				if !ok || !tracked[info.Uses[id]] {
					return true
				}
				name := sel.Sel.Name
				switch {
				case txEndMethods[name]:
					c.report(call, ruleTxEnd, fmt.Sprintf(
						"idemvet: %s of the attempt's transaction: return nil or an error and let the middleware commit or roll back with the claim",
						name))
				case execMethods[name]:
					if q, ok := c.sqlArg(call); ok {
						if stmt, ends := endsTransaction(q, own); ends {
							c.report(call, ruleTxEnd, fmt.Sprintf(
								"idemvet: %s %q ends the attempt's transaction: return nil or an error and let the middleware commit or roll back with the claim",
								name, stmt))
						}
					}
				}
				return true
			})
		}
	}
}

// savepoints returns the names of the savepoints that a declaration creates
// with a constant "SAVEPOINT name" statement, whatever the handle.
func (c *checker) savepoints(d ast.Decl) map[string]bool {
	own := make(map[string]bool)
	ast.Inspect(d, func(n ast.Node) bool {
		call, ok := n.(*ast.CallExpr)
		if !ok {
			return true
		}
		sel, ok := ast.Unparen(call.Fun).(*ast.SelectorExpr)
		if !ok || !execMethods[sel.Sel.Name] {
			return true
		}
		if q, ok := c.sqlArg(call); ok {
			for _, name := range savepointNames(q) {
				own[name] = true
			}
		}
		return true
	})
	return own
}
